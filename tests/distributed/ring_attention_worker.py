"""Worker of test_ring_attention.py: ring attention over gloo against float64 full attention.

    torchrun --nproc_per_node N tests/distributed/ring_attention_worker.py --out DIR [--device cuda]

Every rank builds the same full q, k, v and output gradient (one seed), takes its part with
`split_for_ring`, runs `ring_attention` forward and backward, and compares its output and dq, dk, dv
with the same split of the reference: softmax(Q K^T / sqrt(d) [+ mask]) V in float64 with autograd
(K/V heads repeated for GQA), for packed rows each sequence attended on its own. It also checks
`gather_from_ring` rebuilds the full output. Writes DIR/rank{r}.json: case -> max abs error.
`--device cuda` runs the ring on one GPU per rank over NCCL (the reference stays on the CPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os

import torch
import torch.distributed as dist

from rlhfkit.parallel.ring_attention import (
    gather_from_ring,
    ring_attention,
    split_for_ring,
)


def reference(q, k, v, causal: bool):
    """Full attention in float64: q [B, Hq, S, D], k/v [B, Hk, S, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def reference_packed(q, k, v, cu: list[int], causal: bool):
    """Packed q/k/v [T, H, D]: each sequence attended on its own; tokens past cu[-1] give 0."""
    outs = []
    for a, b in itertools.pairwise(cu):
        sl = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        outs.append(reference(*sl, causal).squeeze(0).transpose(0, 1))
    out = torch.cat(outs)
    return torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])


DEVICE = "cpu"


def run_case(name, shape_q, shape_kv, length, rank, world, *, causal, layout="zigzag", packed_cu=None,
             head_stride=None, q_tile=4096, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dim = 0 if packed_cu else 2  # the sequence dim
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in (shape_q, shape_kv, shape_kv))
    g_out = torch.randn(*shape_q, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference_packed(*ref_in, packed_cu, causal) if packed_cu else reference(*ref_in, causal)
    ref_grads = torch.autograd.grad(ref, ref_in, g_out)

    def split(t):
        return split_for_ring(t, rank, world, dim=dim, layout=layout)

    loc = [split(t).float().to(DEVICE).requires_grad_(True) for t in (q, k, v)]
    kwargs = {"causal": causal, "layout": layout, "head_stride": head_stride, "q_tile": q_tile}
    if packed_cu:
        kwargs["cu_seqlens"] = torch.tensor(packed_cu, dtype=torch.int32)
    else:
        kwargs["total_len"] = length
    out = ring_attention(*loc, dist.group.WORLD, **kwargs)
    grads = torch.autograd.grad(out, loc, split(g_out).float().to(DEVICE))
    out, grads = out.cpu(), [g.cpu() for g in grads]
    errs = {"out": float((out.detach().double() - split(ref.detach())).abs().max())}
    for n, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        errs[n] = float((got.double() - split(want)).abs().max())
    full = gather_from_ring(out.detach().to(DEVICE), dist.group.WORLD, dim=dim, layout=layout, length=length)
    errs["gathered"] = float((full.cpu().double() - ref.detach()).abs().max())
    return {name: errs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    from rlhfkit.parallel.rendezvous import destroy_at_exit

    destroy_at_exit()  # gloo's threads settle before interpreter teardown
    rank, world = dist.get_rank(), dist.get_world_size()
    b, hq, hk, d = 2, 4, 2, 8
    res = {}
    # odd length: split_for_ring pads to a multiple of 2N, total_len masks the padded keys
    res.update(run_case("causal_gqa_odd", (b, hq, 13, d), (b, hk, 13, d), 13, rank, world, causal=True))
    res.update(run_case("noncausal_gqa_odd", (b, hq, 13, d), (b, hk, 13, d), 13, rank, world, causal=False, seed=1))
    res.update(run_case("causal_contiguous", (b, hq, 12, d), (b, hk, 12, d), 12, rank, world, causal=True,
                        layout="contiguous", seed=2))
    res.update(run_case("causal_stride1_tiled", (1, 6, 16, d), (1, 3, 16, d), 16, rank, world, causal=True,
                        head_stride=1, q_tile=3, seed=3))
    cu = [0, 5, 6, 14, 19]
    for layout in ("zigzag", "contiguous"):
        res.update(run_case(f"packed_{layout}", (19, hq, d), (19, hk, d), 19, rank, world, causal=True,
                            layout=layout, packed_cu=cu, seed=4))
    res.update(run_case("packed_noncausal", (19, hq, d), (19, hk, d), 19, rank, world, causal=False,
                        packed_cu=cu, seed=5))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
