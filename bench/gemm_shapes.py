"""Time the decode step's GEMM shapes (Qwen2-0.5B) at small M under two weight layouts.

    python bench/gemm_shapes.py [--rows 64,256]

`linear`: F.linear(x, W) with W [N, K] row-major (what the engine runs); `mm_t`: x @ Wt with a
pre-transposed contiguous Wt [K, N]. Each timed under a CUDA graph of 50 calls; prints JSON with
microseconds per call and the bandwidth (weight bytes / time) each reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "lm_head": (151936, 896)}


def timed(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) * 1000 / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,256")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    out = {"device": torch.cuda.get_device_name(), "results": []}
    for m in map(int, a.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            wt = w.t().contiguous()
            x = torch.randn(m, k, device=dev, dtype=dt)
            row = {"m": m, "shape": name, "n": n, "k": k}
            for label, fn in (("linear", lambda: F.linear(x, w)), ("mm_t", lambda: torch.mm(x, wt))):
                us = timed(fn)
                row[f"{label}_us"] = round(us, 2)
                row[f"{label}_tbps"] = round(w.numel() * 2 / us / 1e6, 2)
            out["results"].append(row)
            print(json.dumps(row), flush=True)
    from rlhfkit.rollout.builtin.kernels import triton_sampling  # noqa: F401 - registers the op

    for m in map(int, a.rows.split(",")):
        logits = torch.randn(m, 151936, device=dev, dtype=dt)
        seeds = torch.arange(m, device=dev)
        ctr = torch.zeros(m, dtype=torch.long, device=dev)
        stop = torch.zeros(m, 8, dtype=torch.long, device=dev)
        ban = torch.zeros(m, 8, dtype=torch.bool, device=dev)
        row = {"m": m, "shape": "sampler", "logit_bytes": logits.numel() * 2}
        for label, t in (("sampled", 1.0), ("greedy", 0.0)):
            temp = torch.full((m,), t, device=dev)
            us = timed(lambda: torch.ops.rlhfkit.sample_partials(logits, temp, stop, ban))
            row[f"{label}_us"] = round(us, 2)
            row[f"{label}_tbps"] = round(logits.numel() * 2 / us / 1e6, 2)
        out["results"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
