"""Training-step throughput (tokens/s) and MFU for a model shape, against a plain baseline.

    python bench/train_throughput.py --model qwen2-0.5b --batch 8 --seq 2048 [--out bench/results/x.json]
    python bench/train_throughput.py --device cpu        # smoke run on the tiny shape

Measured in the same process, same data:
  baseline: plain HF model in bf16 + torch.optim.AdamW, full logits + cross-entropy (what a short
            hand-written loop does);
  rlhfkit:  the SFT task's loss (fused lm_head + log-prob kernel on GPU, no full-vocab logits
            kept) through the FSDP2 backend (bf16 module, fp32 master weights in a fused AdamW,
            grad clipping); other variants (--variants) in the same run.
MFU = 6 * N * tokens/s (+ attention flops) / peak bf16 flops of the GPU. One JSON line is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness

from bench.harness import train_step  # noqa: E402
from bench.harness.train_step import (SHAPES, VARIANTS, baseline_step_fn, build, flops_per_token,  # noqa: E402
                                      format_summary, peak_flops, phase_times, profile_step, rlhfkit_step_fn,
                                      time_steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches (of --batch x --seq) per optimizer step")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--skip_baseline", action="store_true")
    ap.add_argument("--variants", default="master", help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--gpu_lead_ms", type=float, default=0.0,
                    help="also time each rlhfkit variant behind a GPU sleep of this many ms per step (the host "
                         "then never starves the GPU) and report the GPU-only step time and phase split")
    ap.add_argument("--trace", action="store_true", help="with --profile: keep each profiled step's Chrome trace")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="after timing, profile one step of each rlhfkit variant (phases forward / backward / "
                         "optimizer, GPU idle, kernels by class) into PATH.json")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    shape = a.model or ("qwen2-0.5b" if gpu else "tiny")
    batch, seq = a.batch or (8 if gpu else 4), a.seq or (2048 if gpu else 128)
    steps = a.steps or (10 if gpu else 3)
    torch.manual_seed(0)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), device=a.device)
    tokens = batch * seq * a.accum
    name = torch.cuda.get_device_name() if gpu else "cpu"
    res: dict = {"bench": "train_throughput", "device": name, "model": shape, "batch": batch, "seq": seq,
                 "accum": a.accum}
    if not a.skip_baseline:
        model, cfg = build(shape, a.device, torch.bfloat16 if gpu else torch.float32, a.attn)
        n_params = sum(p.numel() for p in model.parameters())
        t = time_steps(baseline_step_fn(model, ids, a.device, a.accum), 2, steps, a.device)
        res["baseline_tokens_per_s"] = tokens / t
        res["baseline_step_s"] = t
        if gpu:
            res["baseline_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        del model
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    profiles: dict = {}
    for variant in a.variants.split(","):
        if gpu:
            torch.cuda.reset_peak_memory_stats()  # the previous variant's profiled step is not this one's peak
        model, cfg = build(shape, a.device, torch.float32, a.attn)
        n_params = sum(p.numel() for p in model.parameters())
        key = "rlhfkit" if variant == a.variants.split(",")[0] else f"rlhfkit_{variant}"
        try:
            step = rlhfkit_step_fn(model, ids, a.device, "bf16" if gpu else "fp32", variant, a.accum)
            t = time_steps(step, 3, steps, a.device)
        except Exception as e:  # noqa: BLE001 - a failing variant is recorded, the others still run
            res[f"{key}_error"] = f"{type(e).__name__}: {e}"[:500]
            del model
            if gpu:
                torch.cuda.empty_cache()
            continue
        res.update({"n_params": n_params, f"{key}_tokens_per_s": tokens / t, f"{key}_step_s": t,
                    f"{key}_host_step_s": sorted(train_step.HOST_S)[len(train_step.HOST_S) // 2]})
        if gpu:
            res[f"{key}_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        if gpu and a.gpu_lead_ms:
            # the same step twice more with phase marks: as timed above, then behind a GPU sleep, whose step
            # time is the GPU's work alone; the difference is the time the GPU waited for the host
            train_step.RECORD_PHASES = True
            res[f"{key}_marked_step_s"] = time_steps(step, 1, steps, a.device)
            res[f"{key}_phases_s"] = phase_times()
            time_steps(step, 1, steps, a.device, lead_ms=a.gpu_lead_ms)
            res[f"{key}_gpu_phases_s"] = {k: v for k, v in phase_times().items() if k != "lead"}
            res[f"{key}_gpu_step_s"] = sum(res[f"{key}_gpu_phases_s"].values())
            train_step.RECORD_PHASES = False
        if a.profile:
            profiles[key] = profile_step(step, top=20, trace_path=f"{a.profile}_{key}.trace.json" if a.trace else None)
            print(f"[{key}]\n" + format_summary(profiles[key]), flush=True)
        fpt = flops_per_token(cfg, n_params, seq)
        peak = peak_flops(name)
        palm = flops_per_token(cfg, n_params, seq, causal_half=False)
        if peak:
            res[f"{key}_mfu"] = res[f"{key}_tokens_per_s"] * fpt / peak
            res[f"{key}_mfu_palm"] = res[f"{key}_tokens_per_s"] * palm / peak
            if "baseline_tokens_per_s" in res:
                res["baseline_mfu"] = res["baseline_tokens_per_s"] * fpt / peak
                res["baseline_mfu_palm"] = res["baseline_tokens_per_s"] * palm / peak
        del model, step
        if gpu:
            torch.cuda.empty_cache()
    res["variants"] = a.variants
    from rlhfkit.models import fused_logprobs

    res["head_grad_fp32_gemm"] = fused_logprobs._OUT_DTYPE_MM and gpu  # fp32-output GEMM for lm_head's grad
    if "baseline_tokens_per_s" in res:
        res["speedup_vs_baseline"] = res["rlhfkit_tokens_per_s"] / res["baseline_tokens_per_s"]
    print(json.dumps(res))
    if a.profile:
        os.makedirs(os.path.dirname(a.profile) or ".", exist_ok=True)
        with open(a.profile + ".json", "w") as f:
            json.dump({"device": name, "model": shape, "batch": batch, "seq": seq, "profiles": profiles}, f, indent=1)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
