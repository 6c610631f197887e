"""Wall time of `make test` on fresh clones, run after run: the test suite's budget (10 minutes on 2 cores).

    python3 bench/suite_times.py --runs 5 --out bench/results/make_test_cpu2.json

Each run clones the repository's HEAD into a new folder and times `make test` there from nothing
(the venv's creation and install included, as CI does); the runs follow one another, so nothing
else shares the machine. The JSON lists each run's seconds, exit status and pytest's summary line,
with the CPU's name, vector units and core count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?)\b.*?) in [\d.]+s")


def pytest_summary(text: str) -> str:
    """pytest's last summary line ("2 failed, 1456 passed, 83 skipped"), or "" where it printed none."""
    found = ""
    for line in text.splitlines():
        m = SUMMARY.match(line.strip())
        if m:
            found = m.group(1)
    return found


def cpuinfo_field(name: str) -> str:
    """The first `name : value` line of /proc/cpuinfo (one per core, all alike), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""


def cpu_name() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> str:
    """The vector units that decide the float rounding of torch's CPU kernels (the tests' numbers depend on it)."""
    flags = cpuinfo_field("flags").split()
    return " ".join(x for x in ("avx2", "avx512f", "amx_bf16") if x in flags)


def one_run(index: int, work: str, log_dir: str) -> dict:
    clone = os.path.join(work, f"run-{index}")
    subprocess.run(["git", "clone", "--quiet", ROOT, clone], check=True)
    log_path = os.path.join(log_dir, f"make_test_{index}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(["make", "test"], cwd=clone, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - start
    with open(log_path, errors="replace") as f:
        summary = pytest_summary(f.read())
    shutil.rmtree(clone, ignore_errors=True)
    return {"run": index, "seconds": round(seconds, 1), "exit_status": rc, "pytest": summary, "log": log_path}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", required=True, help="JSON file to write (rewritten after every run)")
    ap.add_argument("--log_dir", default=None, help="where each run's output goes (default: a temp folder)")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="suite-times-")
    os.makedirs(log_dir, exist_ok=True)
    result = {"what": "fresh-clone `make test`, wall seconds per run, consecutive", "commit": head,
              "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "budget_seconds": 600, "runs": []}
    with tempfile.TemporaryDirectory(prefix="suite-times-") as work:
        for i in range(1, args.runs + 1):
            row = one_run(i, work, log_dir)
            result["runs"].append(row)
            secs = [r["seconds"] for r in result["runs"]]
            result["max_seconds"], result["all_passed"] = max(secs), all(r["exit_status"] == 0 for r in result["runs"])
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
            print(f"run {i}: {row['seconds']:.0f} s, exit {row['exit_status']}, {row['pytest']}", flush=True)
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
