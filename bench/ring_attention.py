"""Time ring attention's forward + backward for one sequence split over the ranks of a ring.

    python bench/ring_attention.py --seq_len 512 --heads 4 --kv_heads 2            # one process
    torchrun --nproc_per_node 4 bench/ring_attention.py --seq_len 32768 --heads 28 --kv_heads 4 \
        --head_dim 128 --dtype bf16                                                # a ring of 4 (NCCL on CUDA)

Each rank holds its zig-zag part (`seq_len / ranks` tokens) of a causal sequence and runs
`ring_attention` forward and backward `--iters` times after `--warmup`; `--kernel` picks the block
attention (default auto: the flash kernel on CUDA with fp16/bf16, else the math path). Rank 0 prints
one JSON line: milliseconds per fwd+bwd (the slowest rank's mean), tokens/s of the whole sequence, peak
memory on rank 0 (CUDA only), and the attention TFLOP/s per rank (causal: 2 * B * Hq * S^2 * D for the
forward, 2.5 times that for the backward). With one process on CUDA, `--baseline` also times PyTorch's fused
`scaled_dot_product_attention` on the full sequence (the single-GPU roofline to compare against).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhfkit.parallel.ring_attention import KERNELS, padded_length, ring_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=32)
    ap.add_argument("--head_stride", type=int, default=None, help="--ring_head_stride: KV heads per ring pass")
    ap.add_argument("--q_tile", type=int, default=4096)
    ap.add_argument("--kernel", choices=KERNELS, default="auto",
                    help="block attention: auto (flash/efficient on CUDA fp16/bf16, else math), math, ...")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--baseline", action="store_true", help="also time SDPA on the full sequence (one process)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        from rlhfkit.parallel.rendezvous import destroy_at_exit

        destroy_at_exit()  # gloo's threads settle before interpreter teardown
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    full = padded_length(args.seq_len, world)
    local = full // world
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    q = torch.randn(args.batch, args.heads, local, args.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(args.batch, args.kv_heads, local, args.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    for t in (q, k, v):
        t.requires_grad_(True)
    grad = torch.randn_like(q)
    group = dist.group.WORLD if dist.is_initialized() else None

    def step():
        out = ring_attention(q, k, v, group, causal=True, total_len=args.seq_len, head_stride=args.head_stride,
                             q_tile=args.q_tile, kernel=args.kernel)
        out.backward(grad)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    sec = _time(step, device, args.warmup, args.iters)
    if dist.is_initialized():
        t = torch.tensor([sec], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        sec = float(t.item())
    fwd_flops = 2.0 * args.batch * args.heads * args.seq_len ** 2 * args.head_dim  # causal: half of 4*S^2*D
    res = {
        "bench": "ring_attention", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "backend": (dist.get_backend() if dist.is_initialized() else "none"), "ranks": world,
        "seq_len": args.seq_len, "local_len": local, "batch": args.batch, "heads": args.heads,
        "kv_heads": args.kv_heads, "head_dim": args.head_dim, "head_stride": args.head_stride or args.kv_heads,
        "dtype": args.dtype, "kernel": args.kernel, "ms_fwd_bwd": round(sec * 1e3, 3),
        "tokens_per_s": round(args.batch * args.seq_len / sec, 1),
        "tflops_per_rank": round(3.5 * fwd_flops / world / sec / 1e12, 3),
        "peak_mem_gib_rank0": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 3) if cuda else None,
    }
    if args.baseline and world == 1 and cuda:
        qf, kf, vf = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

        def sdpa():
            out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
            out.backward(grad)

        base = _time(sdpa, device, args.warmup, args.iters)
        res["sdpa_ms_fwd_bwd"] = round(base * 1e3, 3)
        res["ring_over_sdpa"] = round(sec / base, 3)
    if rank == 0:
        print(json.dumps(res), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
