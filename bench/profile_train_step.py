"""Profile one training step (baseline HF loss vs rlhfkit's) and print the top CUDA kernels.

    python bench/profile_train_step.py [--model qwen2-0.5b --batch 8 --seq 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness

from bench.harness.train_step import baseline_step_fn, build, rlhfkit_step_fn  # noqa: E402


def profile(step, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    print(f"===== {label}")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))
    from bench.harness.step_profile import format_summary, summarize_trace

    path = f"/tmp/profile_train_{os.getpid()}.json"
    p.export_chrome_trace(path)
    with open(path) as f:
        print(format_summary(summarize_trace(json.load(f), prefix="<none>/")))
    os.remove(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--variants", default="master", help="rlhfkit variants (see harness/train_step.py rlhfkit_step_fn)")
    a = ap.parse_args()
    ids = torch.randint(0, 1000, (a.batch, a.seq), device="cuda")
    model, _ = build(a.model, "cuda", torch.bfloat16, "sdpa")
    profile(baseline_step_fn(model, ids, "cuda"), "baseline", a.rows)
    del model
    torch.cuda.empty_cache()
    for variant in a.variants.split(","):
        model, _ = build(a.model, "cuda", torch.float32, "sdpa")
        profile(rlhfkit_step_fn(model, ids, "cuda", "bf16", variant), f"rlhfkit {variant}", a.rows)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
