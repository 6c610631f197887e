"""Where the host's time goes in the compiled SFT step of bench/train_throughput.py (issue 18).

    python3 bench/probe/host_time.py --out DIR [--seconds 40]

The step (Qwen2-0.5B shape, 8 x 2048, --torch_compile) runs behind a GPU sleep long enough that the
host is never waited for; then the host's own time per phase (forward, backward, optimizer) is what it
takes to launch that phase. Writes DIR/host_time.json. While it loops for --seconds after warm-up it
writes DIR/ready with its pid, so a sampler (py-spy) can attach for the loop alone; then one step
runs under torch.profiler with CPU activity only, and the ops by host self time are written too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import itertools

import torch
import train_throughput as tt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--lead_ms", type=float, default=150.0)
    ap.add_argument("--variant", default="master_compile")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model, _ = tt.build("qwen2-0.5b", "cuda", torch.float32, "sdpa")
    torch.manual_seed(0)
    ids = torch.randint(0, tt.SHAPES["qwen2-0.5b"]["vocab_size"], (8, 2048), device="cuda")
    step = tt.rlhfkit_step_fn(model, ids, "cuda", "bf16", a.variant)
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

    plain_phases = {}
    for lead in (False, True):
        for _ in range(3):
            lead_step(lead)
        torch.cuda.synchronize()
        host_marks.clear()
        tt.PHASE_MARKS.clear()
        for _ in range(15):
            lead_step(lead)
        torch.cuda.synchronize()
        plain_phases["lead" if lead else "plain"] = {
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
           "phases_unsampled": plain_phases,
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
