"""Host memory of loading a large model: the peak growth of the process's resident memory against the
bytes it keeps (rlhfkit.models.stream_load).

    python bench/load_memory.py --shape qwen2.5-32b --out bench/results/load_memory_32b_h100.json
    python bench/load_memory.py --shape qwen2.5-32b --path backend --lora_rank 16     # the LoRA policy's path
    torchrun --nproc_per_node 4 bench/load_memory.py --shape qwen2.5-32b --path backend --lora_rank 16
    python bench/load_memory.py --shape qwen2.5-7b --whole      # transformers' from_pretrained on the host, then .to

The model directory (`--model_dir`, default /tmp/bench_<shape>) is written first if missing
(harness/models.py `make_bench_model`: random bf16 weights, drawn on the GPU tensor by tensor). Then, with the
peak (VmHWM) reset through /proc/self/clear_refs, one load:

    device     load_causal_lm(cfg, device="cuda"): built on the meta device, the safetensors streamed
               onto the GPU 16 MiB at a time (what interactive_chat / batch_inference do)
    backend    load_causal_lm(cfg, master_dtype="fp32", defer_weights=True) + FSDP2Backend (the
               trainers' path): with a process group (torchrun) each rank streams only its FSDP2 shards;
               --lora_rank > 0 keeps the base in bf16 (a 32B full fine-tune's fp32 masters need 4+ GPUs)
    --whole    the old path for comparison: from_pretrained into host memory, then to the GPU

One JSON line per run (rank 0, with every rank's numbers): host_peak_extra_bytes, host_kept_bytes (parameters
and buffers on the host), gpu_kept_bytes, gpu_peak_bytes, model_bytes (the checkpoint's size), seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from rlhfkit.utils.host_memory import reset_peak, status_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        out.append(t.to_local() if hasattr(t, "to_local") else t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-32b")
    ap.add_argument("--model_dir", default=None)
    ap.add_argument("--path", choices=("device", "backend"), default="device")
    ap.add_argument("--whole", action="store_true", help="transformers' from_pretrained on the host, then .to")
    ap.add_argument("--lora_rank", type=int, default=0)
    ap.add_argument("--disk_dtype", default="bf16", choices=["bf16", "fp8"],
                    help="the random model's safetensors (fp8: the 32B shape on a 64 GiB disk; loaded as bf16)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from bench.harness.models import make_bench_model

    from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig
    from rlhfkit.models.stream_load import build_meta_model, safetensors_index
    from rlhfkit.parallel import init_distributed

    torchrun = "RANK" in os.environ
    dist = init_distributed(a.device) if torchrun else None
    rank = dist.rank if dist else 0
    device = dist.device if dist else a.device
    path = a.model_dir or f"/tmp/bench_{a.shape}"
    if rank == 0:
        make_bench_model(path, a.shape, device=device, disk_dtype=a.disk_dtype)
    if torchrun:
        torch.distributed.barrier()
    from transformers import AutoModelForCausalLM

    build_meta_model(AutoModelForCausalLM, path, torch.bfloat16)  # the imports loading does (not counted)
    model_bytes = sum(e.end - e.start for e in safetensors_index(path).values())
    cfg = ModelConfig(pretrain=path, param_dtype="bf16", lora_rank=a.lora_rank, lora_alpha=2 * max(a.lora_rank, 1))
    torch.cuda.reset_peak_memory_stats() if device.startswith("cuda") else None
    reset_peak()  # the peak (VmHWM) starts again from the current RSS
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    from rlhfkit.models.loader import load_causal_lm

    if a.whole:
        model = load_causal_lm(cfg, master_dtype="fp32" if a.path == "backend" else None)
    elif a.path == "device":
        model = load_causal_lm(cfg, device=device)
    else:
        model = load_causal_lm(cfg, master_dtype="fp32", defer_weights=True)
    if a.path == "backend":
        from rlhfkit.backend import FSDP2Backend
        from rlhfkit.parallel.dist import DistInfo

        optim = OptimConfig(learning_rate=1e-5)
        model = FSDP2Backend(model, BackendConfig(zero_stage=3, param_dtype="bf16", device=device), optim, 1,
                             dist or DistInfo(device=device)).model
    elif a.whole:
        model = model.to(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM") - before
    ts = _tensors(model)
    res = {"rank": rank, "host_peak_extra_bytes": peak,
           "host_kept_bytes": sum(t.numel() * t.element_size() for t in ts if t.device.type == "cpu"),
           "gpu_kept_bytes": sum(t.numel() * t.element_size() for t in ts if t.device.type == "cuda"),
           "gpu_peak_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0,
           "seconds": round(seconds, 2)}
    ranks = [res]
    if torchrun:
        ranks = [None] * dist.world_size
        torch.distributed.all_gather_object(ranks, res)
    if rank == 0:
        line = {"bench": "load_memory", "shape": a.shape, "path": a.path, "whole": a.whole, "lora_rank": a.lora_rank,
                "world": len(ranks), "model_bytes": model_bytes,
                "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                "host_peak_extra_gib_max": round(max(r["host_peak_extra_bytes"] for r in ranks) / 2**30, 2),
                "ranks": ranks}
        print(json.dumps(line))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(line, f, indent=1)


if __name__ == "__main__":
    main()
