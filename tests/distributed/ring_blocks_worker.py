"""Worker of test_ring_attention.py: the rectangle path (kernel="blocks") against the math path.

    torchrun --nproc_per_node N tests/distributed/ring_blocks_worker.py --out DIR

Every rank builds the same full inputs (one seed), takes its part with `split_for_ring`, runs
`ring_attention` forward and backward with kernel="math" and with kernel="blocks" (the driver the CUDA
kernels use, here with the math kernel) in float32 over gloo, and writes DIR/rank{r}.json:
case -> {"out", "dq", "dk", "dv"} max abs difference between the two over max(1, max abs of the math one).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from rlhfkit.parallel.ring_attention import ring_attention, split_for_ring

CU = [0, 7, 8, 23, 30, 41]  # five sequences (one of length 1) in a row of 44 or more: padding at the end


def run_case(rank, world, *, packed, causal=True, layout="zigzag", head_stride=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hq, hk, d = 6, 2, 8
    if packed:
        t = 44
        shapes, dim = ((t, hq, d), (t, hk, d)), 0
    else:
        shapes, dim = ((2, hq, 29, d), (2, hk, 29, d)), 2
    q, k, v = (torch.randn(*s, generator=gen) for s in (shapes[0], shapes[1], shapes[1]))
    g_out = torch.randn(*shapes[0], generator=gen)
    kw = {"causal": causal, "layout": layout, "head_stride": head_stride}
    if packed:
        kw["cu_seqlens"] = torch.tensor(CU, dtype=torch.int32)
    else:
        kw["total_len"] = 29
    split = [split_for_ring(x, rank, world, dim=dim, layout=layout) for x in (q, k, v, g_out)]
    res = {}
    for kernel in ("math", "blocks"):
        x = [s.clone().requires_grad_(True) for s in split[:3]]
        out = ring_attention(*x, dist.group.WORLD, kernel=kernel, **kw)
        res[kernel] = [out.detach(), *torch.autograd.grad(out, x, split[3])]
    return {n: float((a - b).abs().max()) / max(1.0, float(a.abs().max()))
            for n, a, b in zip(("out", "dq", "dk", "dv"), res["math"], res["blocks"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from rlhfkit.parallel.rendezvous import destroy_at_exit

    destroy_at_exit()  # gloo's threads settle before interpreter teardown
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {
        "packed_zigzag": run_case(rank, world, packed=True),
        "packed_contiguous": run_case(rank, world, packed=True, layout="contiguous", seed=1),
        "packed_stride1": run_case(rank, world, packed=True, head_stride=1, seed=2),
        "packed_noncausal": run_case(rank, world, packed=True, causal=False, seed=3),
        "padded_causal": run_case(rank, world, packed=False, seed=4),
        "padded_noncausal": run_case(rank, world, packed=False, causal=False, seed=5),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
