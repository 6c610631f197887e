"""Where the host's time goes in the compiled SFT step of bench/harness/train_step.py (issue 18).

    python3 bench/probe/host_time.py --out DIR [--seconds 40]

Host seconds per phase (forward, backward, optimizer; median of 15 steps) beside the GPU's (CUDA events),
twice: the step as it is timed (plain), and behind a --lead_ms GPU sleep per step (lead), where the host
is never waited for. In the lead run the backward's host time includes waits on a full launch queue, so
compare the forward's. Writes DIR/host_time.json. Then it loops for --seconds behind the sleep and
writes DIR/ready with its pid, so that a sampler (py-spy) can attach to the loop alone (a sampler that
pauses the process inflates the loop's own numbers), and runs one step under torch.profiler with CPU
activity only: DIR/host_ops.txt, the ops by host self time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import itertools

import torch
from bench.harness import train_step as tt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--lead_ms", type=float, default=150.0)
    ap.add_argument("--variant", default="master_compile")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    step = tt.gpu_sft_step(a.variant)
    plain = tt.time_steps(step, 3, 10, "cuda")

    host_marks: list[tuple[str, float]] = []
    tt.RECORD_PHASES = True
    event_mark = tt.mark
    tt.mark = lambda name: (host_marks.append((name, time.perf_counter())), event_mark(name))
    cycles = int(a.lead_ms * tt.sleep_cycles_per_ms())

    def lead_step(lead: bool = True) -> None:
        if lead:
            tt.mark("lead")
            torch.cuda._sleep(cycles)
        tt.mark("forward")
        step()
        tt.mark("end")

    def host_phases() -> dict[str, float]:
        host: dict[str, list[float]] = {}
        for (name, t), (_, t1) in itertools.pairwise(host_marks):
            if name not in ("end", "lead"):
                host.setdefault(name, []).append(t1 - t)
        return {k: sorted(v)[len(v) // 2] for k, v in host.items()}

    phases_by_mode = {}
    for lead in (False, True):
        for _ in range(3):
            lead_step(lead)
        torch.cuda.synchronize()
        host_marks.clear()
        tt.PHASE_MARKS.clear()
        for _ in range(15):
            lead_step(lead)
        torch.cuda.synchronize()
        phases_by_mode["lead" if lead else "plain"] = {
            "host_s": host_phases(),
            "gpu_s": {k: v for k, v in tt.phase_times().items() if k not in ("lead", "end")}}

    for _ in range(3):
        lead_step()
    torch.cuda.synchronize()
    host_marks.clear()
    tt.PHASE_MARKS.clear()
    n = 0
    with open(os.path.join(a.out, "ready"), "w") as f:
        f.write(str(os.getpid()))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        lead_step()
        n += 1
    torch.cuda.synchronize()
    host: dict[str, list[float]] = {}
    for (name, t), (nxt, t1) in itertools.pairwise(host_marks):
        if name != "end":
            host.setdefault(name, []).append(t1 - t)
    gpu_phases = {k: v for k, v in tt.phase_times().items() if k not in ("lead", "end")}
    res = {"device": torch.cuda.get_device_name(), "variant": a.variant, "steps": n, "plain_step_s": plain,
           "phases_unsampled": phases_by_mode,
           "gpu_step_s": sum(gpu_phases.values()), "host_s": {k: sorted(v)[len(v) // 2] for k, v in host.items() if k != "lead"},
           "gpu_s": gpu_phases,
           "note": "host_s: median host seconds per phase with the GPU asleep ahead of it (optimizer "
                   "includes the wait for the backward's flags); gpu_s: mean GPU seconds per phase"}
    tt.RECORD_PHASES = False
    tt.mark = event_mark
    from torch.profiler import ProfilerActivity, profile

    lead_step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lead_step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=90)
    with open(os.path.join(a.out, "host_ops.txt"), "w") as f:
        f.write(table)
    with open(os.path.join(a.out, "host_time.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
