"""Where the GPU waits inside the compiled SFT step of bench/harness/train_step.py (issue 18).

    python3 bench/probe/gpu_gaps.py --out DIR [--steps 5] [--variant master_compile]

Times the step, then runs --steps more under torch.profiler with CUDA activity only (kernel
timestamps from CUPTI, no CPU op recording, so the host runs as it does unprofiled) and reads the
trace: per step the span from first kernel start to last kernel end, the busy time (union of kernel
intervals), and the idle gaps, grouped by the kernels on either side. Writes DIR/gpu_gaps.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import torch
from bench.harness import train_step as tt


def gaps_of(trace: dict, min_gap_us: float = 3.0) -> dict:
    evs = sorted((e for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    busy, end, gaps = 0.0, None, []
    prev = None
    for e in evs:
        s, d = float(e["ts"]), float(e["dur"])
        if end is None:
            busy, end = d, s + d
        else:
            if s > end:
                busy += d
                if s - end >= min_gap_us:
                    gaps.append((s - end, prev["name"][:70], e["name"][:70], s))
            elif s + d > end:
                busy += s + d - end
            end = max(end, s + d)
        prev = e
    span = end - float(evs[0]["ts"])
    by_pair: dict = defaultdict(lambda: [0, 0.0])
    for g, a, b, _ in gaps:
        by_pair[(a, b)][0] += 1
        by_pair[(a, b)][1] += g
    top = sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:25]
    return {"kernels": len(evs), "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "idle_in_gaps_over_min_ms": sum(g for g, *_ in gaps) / 1e3, "n_gaps": len(gaps),
            "largest_ms": [round(g / 1e3, 3) for g, *_ in sorted(gaps, reverse=True)[:12]],
            "top_pairs": [{"before": a, "after": b, "n": n, "ms": round(t / 1e3, 3)} for (a, b), (n, t) in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variant", default="master_compile")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    step = tt.gpu_sft_step(a.variant)
    plain = tt.time_steps(step, 3, 20, "cuda")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    after = tt.time_steps(step, 1, 20, "cuda")
    res = {"device": torch.cuda.get_device_name(), "variant": a.variant, "plain_step_s": plain,
           "plain_step_after_s": after, "profiled_steps": a.steps, "gaps": gaps_of(trace)}
    res["gaps"]["per_step_span_ms"] = res["gaps"]["span_ms"] / a.steps
    res["gaps"]["per_step_busy_ms"] = res["gaps"]["busy_ms"] / a.steps
    with open(os.path.join(a.out, "gpu_gaps.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
