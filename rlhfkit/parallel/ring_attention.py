"""Ring attention (context parallelism): exact attention over a sequence split across the ranks of a group.

    full sequence [.., S, ..]
      |  split_for_ring(x, rank, world, dim)     zig-zag: rank i holds chunks i and 2N-1-i of 2N
      v                                          (right-padded to a multiple of 2N)
    local q, k, v  --ring_attention(q, k, v, group)-->  local out        (fwd: K/V go round the ring,
      |                                                                  partial results merged by
      |  gather_from_ring(out, group, dim, length=S)                     log-sum-exp; bwd: K/V and
      v                                                                  dK/dV go round again)
    full output

Shapes (two forms, chosen by whether `cu_seqlens` is given):

* padded: q [B, Hq, S_local, D], k/v [B, Hkv, S_local, D] (the layout HF attention functions get);
  every row is the same sequence length `S = S_local * world`; pass `total_len` (the real length)
  when the split padded it: padded keys are never attended and padded queries attend nothing (0).
* packed: q [T_local, Hq, D], k/v [T_local, Hkv, D] (flash-attn varlen layout), several sequences in
  one packed row of `T = T_local * world` tokens; `cu_seqlens` (int, n + 1 entries, from 0 to the real
  token count <= T) are the boundaries in the *full* row, the same on every rank. A token attends only
  inside its own sequence; tokens past `cu_seqlens[-1]` (the split's padding) attend nothing and give 0.
  `cu_seqlens_from_position_ids` turns packed position ids into `cu_seqlens`.

Grouped-query attention: Hq is a multiple of Hkv and query head h uses KV head h // (Hq / Hkv)
(transformers' `repeat_kv` order); K/V are never expanded.

Layouts (`layout=`, the same for the split, the attention and the gather; ring_layout.py): "zigzag" (default) cuts
the (padded) row into 2N equal chunks and gives rank i chunks i and 2N-1-i, so under the causal mask
every rank does the same work; "contiguous" gives rank i the i-th of N equal chunks (what OpenRLHF
does to a packed row). The mask is built from each token's global position (and sequence id), so
both layouts, padding and packing go through one code path; a block of the ring whose mask is empty
is skipped, and only the covering sub-rectangle of a partly visible block is computed (with zig-zag
that halves the work of every off-diagonal block).

Algorithm (ring attention over blockwise attention; the merge and the backward are
FlashAttention-2's). Rank r of N holds Q_r, K_r, V_r.

* forward: for j = 0..N-1 it attends Q_r to the block K/V of rank (r - j) mod N, giving a normalised
  partial output O_j and log-sum-exp L_j per query row, while the next block is already in flight
  (isend to r+1, irecv from r-1). Partials merge exactly: L = log(e^L_a + e^L_b),
  O = e^(L_a - L) O_a + e^(L_b - L) O_b (`merge_attention`). Saved: q, k, v, O, L (O(S_local)).
* backward: with D = rowsum(dO * O), each block recomputes P = exp(Q K^T * scale - L) and gives
  dV += P^T dO, dS = P * (dO V^T - D), dQ += dS K * scale, dK += dS^T Q * scale. K/V travel the ring
  again, and each block's fp32 dK/dV accumulator travels with it one step behind (sent while the
  next block computes); after N steps every rank receives the accumulator of its own block.

`head_stride` (OpenRLHF's `--ring_head_stride`, ring_flash_attn's `heads_k_stride`): the number of
KV heads (with their Hq/Hkv query heads each) that go round the ring together. None: all heads in
one pass. A smaller stride sends smaller messages and bounds the fp32 score and buffer memory to that
many heads, at the cost of Hkv/head_stride ring passes. `q_tile` bounds the rows of one score matrix.

Block attention (`kernel=`, parallel/ring_blocks.py). The math path ("math") computes each block in
fp32 torch math with a materialised mask (CPU/gloo and CUDA/NCCL alike; inputs of any float dtype, the
output in the input's dtype, log-sum-exp and dK/dV accumulators in fp32; float64 inputs are computed
in float64 throughout, which lets `torch.autograd.gradcheck` check the backward). The rectangle path
splits what a block sees into FULL and CAUSAL rectangles (`block_rectangles`: zig-zag runs cut by the
packed sequences) and runs a fused kernel on each, merging out/lse in fp32; its backward gives each
rectangle the final out and lse (FlashAttention-2's backward). Kernels: "flash" (torch's
FlashAttention-2 ops), "efficient" (torch's memory-efficient ops), "blocks" (the math kernel: the CPU
tests drive the same driver). "auto" (the default) takes flash, else efficient, on CUDA with fp16/bf16
inputs where a small probe on that device matched the math, else the math path.

The models and trainers use it through parallel/context_parallel.py (`--ring_attn_size`,
`--ring_head_stride`): the FSDP2 backend installs it as a transformers attention function and splits
every batch (always in the packed form), with kernel "auto". tests/gpu/test_ring_flash.py times the
math and flash paths against each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlhfkit.parallel.ring_blocks import (
    _GRAD_TAG,
    _KV_TAG,
    KERNELS,
    _block_backward,
    _block_forward,
    backward_rects,
    block_rectangles,
    forward_rects,
    merge_attention,
    pick_kernel,
)
from rlhfkit.parallel.ring_layout import (  # noqa: F401 - re-exported: the layout is part of this module's API
    LAYOUTS,
    _num_chunks,
    _world,
    cu_seqlens_from_position_ids,
    gather_from_ring,
    padded_length,
    ring_positions,
    split_for_ring,
    unsplit_ring,
)

__all__ = [
    "KERNELS",
    "LAYOUTS",
    "cu_seqlens_from_position_ids",
    "gather_from_ring",
    "merge_attention",
    "padded_length",
    "ring_attention",
    "ring_positions",
    "split_for_ring",
    "unsplit_ring",
]


# ---------------------------------------------------------------------------------------------- ring plumbing

@dataclass
class _Ring:
    """Where this rank sits in the ring and what its blocks may see of each other."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    causal: bool
    scale: float
    head_stride: int
    q_tile: int
    acc: torch.dtype   # accumulation dtype: float32, or float64 for float64 inputs
    pos: list          # global positions of each rank's tokens, [S_local] each
    seg: list | None   # sequence id of each rank's tokens (-1: padding), packed form only
    total_len: int | None
    layout: str = "zigzag"
    bounds: list[int] = field(default_factory=list)  # sequence boundaries in the full row (padded form: [0, real length])
    kern: object = None         # a ring_blocks kernel (the rectangle path), None: the math path

    def peers(self) -> tuple[int, int]:
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        if self.group is None:
            return nxt, prv
        return dist.get_global_rank(self.group, nxt), dist.get_global_rank(self.group, prv)

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending `send` to the next rank and receiving the same shape from the previous one
        (`tag`: K/V blocks and dK/dV accumulators travel at once in the backward; gloo matches by tag,
        NCCL by order, which is the same on every rank)."""
        nxt, prv = self.peers()
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, nxt, self.group, tag),
               dist.P2POp(dist.irecv, recv, prv, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    def plan(self, src: int):
        """(q rows, k cols, mask of that rectangle or None) for this rank's queries against rank `src`'s
        keys, or None when no query sees any key of that block."""
        qi, ki = self.pos[self.rank], self.pos[src]
        m = None
        if self.causal:
            m = ki.unsqueeze(0) <= qi.unsqueeze(1)
        if self.seg is not None:
            sq, sk = self.seg[self.rank], self.seg[src]
            same = (sq.unsqueeze(1) == sk.unsqueeze(0)) & (sk >= 0).unsqueeze(0)
            m = same if m is None else m & same
        elif self.total_len is not None:
            valid = (qi < self.total_len).unsqueeze(1) & (ki < self.total_len).unsqueeze(0)
            m = valid if m is None else m & valid
        if m is None:
            return slice(None), slice(None), None
        rows, cols = torch.nonzero(m.any(1)).flatten(), torch.nonzero(m.any(0)).flatten()
        if rows.numel() == 0:
            return None
        qs, ks = slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
        sub = m[qs, ks]
        return qs, ks, (None if bool(sub.all()) else sub)

    def tiles(self, qs: slice, n: int):
        start, stop = qs.start or 0, n if qs.stop is None else qs.stop
        for a in range(start, stop, self.q_tile):
            yield slice(a, min(a + self.q_tile, stop))


def _sub_mask(mask, qt: slice, qs: slice):
    if mask is None:
        return None
    return mask[qt.start - (qs.start or 0): qt.stop - (qs.start or 0)]


def _forward_heads(ring: _Ring, q, k, v, plans):
    """One ring pass for one head group: q [B, Hk, g, S, D] fp32, k/v [B, Hk, S, D] -> out, lse."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    for j in range(ring.world):
        src = (ring.rank - j) % ring.world
        pending = ring.exchange(kv, _KV_TAG) if j < ring.world - 1 else None
        plan = plans[src]
        if plan is not None:
            qs, ks, mask = plan
            kb, vb = kv[0][:, :, ks].to(q.dtype), kv[1][:, :, ks].to(q.dtype)
            for qt in ring.tiles(qs, q.shape[3]):
                o_b, l_b = _block_forward(q[:, :, :, qt], kb, vb, _sub_mask(mask, qt, qs), ring.scale)
                out[:, :, :, qt], lse[:, :, :, qt] = merge_attention(out[:, :, :, qt], lse[:, :, :, qt], o_b, l_b)
        if pending is not None:
            recv, works = pending
            for w in works:
                w.wait()
            kv = recv
    return out, lse


def _backward_heads(ring: _Ring, q, k, v, dout, lse, delta, plans):
    """One backward ring pass for one head group -> dq (like q), dk, dv (fp32, like k)."""
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v]).contiguous()
    acc, acc_pending = None, None
    for j in range(ring.world):
        src = (ring.rank - j) % ring.world
        pending = ring.exchange(kv, _KV_TAG) if j < ring.world - 1 else None
        contrib = torch.zeros((2, *k.shape), dtype=q.dtype, device=k.device)
        plan = plans[src]
        if plan is not None:
            qs, ks, mask = plan
            kb, vb = kv[0][:, :, ks].to(q.dtype), kv[1][:, :, ks].to(q.dtype)
            for qt in ring.tiles(qs, q.shape[3]):
                dq_t, dk_t, dv_t = _block_backward(q[:, :, :, qt], kb, vb, dout[:, :, :, qt], lse[:, :, :, qt],
                                                   delta[:, :, :, qt], _sub_mask(mask, qt, qs), ring.scale)
                dq[:, :, :, qt] += dq_t
                contrib[0][:, :, ks] += dk_t
                contrib[1][:, :, ks] += dv_t
        if acc_pending is not None:  # the accumulator of block src, one step behind on the ring
            recv, works = acc_pending
            for w in works:
                w.wait()
            contrib += recv
        acc = contrib
        if ring.world > 1:
            acc_pending = ring.exchange(acc, _GRAD_TAG)
        if pending is not None:
            recv, works = pending
            for w in works:
                w.wait()
            kv = recv
    if acc_pending is not None:  # after N steps the previous rank hands over this rank's own block
        recv, works = acc_pending
        for w in works:
            w.wait()
        acc = recv
    assert acc is not None  # world >= 1: one pass at least
    return dq, acc[0], acc[1]


def _head_groups(ring: _Ring, hk: int):
    for h in range(0, hk, ring.head_stride):
        yield slice(h, h + ring.head_stride)


class _RingAttention(torch.autograd.Function):
    """q [B, Hq, S, D], k/v [B, Hk, S, D] (padded form) -> out [B, Hq, S, D]; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        b, hq, s, d = q.shape
        hk = k.shape[1]
        if ring.kern is not None:
            out, lse = _rect_forward(ring, q, k, v)
        else:
            plans = [ring.plan(src) for src in range(ring.world)]
            q5 = q.to(ring.acc).reshape(b, hk, hq // hk, s, d)
            out = torch.empty_like(q5)
            lse = torch.empty(q5.shape[:-1], dtype=ring.acc, device=q.device)
            for hs in _head_groups(ring, hk):
                out[:, hs], lse[:, hs] = _forward_heads(ring, q5[:, hs], k[:, hs], v[:, hs], plans)
        out = out.view(b, hq, s, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        if ring.kern is not None:
            dq, dk, dv = _rect_backward(ring, q, k, v, dout, out, lse)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
        b, hq, s, d = q.shape
        hk = k.shape[1]
        plans = [ring.plan(src) for src in range(ring.world)]
        shape5 = (b, hk, hq // hk, s, d)
        q5, do5 = q.to(ring.acc).reshape(shape5), dout.to(ring.acc).reshape(shape5)
        delta = (do5 * out.to(ring.acc).reshape(shape5)).sum(-1)
        dq = torch.empty_like(q5)
        dk = torch.empty(k.shape, dtype=ring.acc, device=k.device)
        dv = torch.empty_like(dk)
        for hs in _head_groups(ring, hk):
            dq[:, hs], dk[:, hs], dv[:, hs] = _backward_heads(ring, q5[:, hs], k[:, hs], v[:, hs], do5[:, hs],
                                                              lse[:, hs], delta[:, hs], plans)
        return dq.view(b, hq, s, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _rects(ring: _Ring, s: int):
    return [block_rectangles(s, ring.rank, src, ring.world, ring.layout, ring.causal, ring.bounds)
            for src in range(ring.world)]


def _q_heads(hs: slice, g: int) -> slice:
    return slice(hs.start * g, hs.stop * g)


def _rect_forward(ring: _Ring, q, k, v):
    """The rectangle path (ring_blocks): out fp32 [B, Hq, S, D], lse fp32 [B, Hq, S]."""
    g = q.shape[1] // k.shape[1]
    rects = _rects(ring, q.shape[2])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(q.shape, dtype=ring.acc, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=ring.acc, device=q.device)
    for hs in _head_groups(ring, k.shape[1]):
        qh = _q_heads(hs, g)
        out[:, qh], lse[:, qh] = forward_rects(ring, ring.kern, q[:, qh], k[:, hs], v[:, hs], rects)
    return out, lse


def _rect_backward(ring: _Ring, q, k, v, dout, out, lse):
    g = q.shape[1] // k.shape[1]
    rects = _rects(ring, q.shape[2])
    q, k, v, dout, out = (t.contiguous() for t in (q, k, v, dout.to(q.dtype), out))
    dq = torch.empty(q.shape, dtype=ring.acc, device=q.device)
    dk = torch.empty(k.shape, dtype=ring.acc, device=k.device)
    dv = torch.empty_like(dk)
    for hs in _head_groups(ring, k.shape[1]):
        qh = _q_heads(hs, g)
        dq[:, qh], dk[:, hs], dv[:, hs] = backward_rects(ring, ring.kern, q[:, qh], k[:, hs], v[:, hs],
                                                         dout[:, qh], out[:, qh], lse[:, qh], rects)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- entry point

def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   causal: bool = True, cu_seqlens: torch.Tensor | None = None, scale: float | None = None,
                   total_len: int | None = None, layout: str = "zigzag", head_stride: int | None = None,
                   q_tile: int = 4096, kernel: str = "auto") -> torch.Tensor:
    """Exact softmax(Q K^T * scale [+ causal mask]) V for this rank's part of a sequence split over `group`.

    Padded form: q [B, Hq, S_local, D], k/v [B, Hkv, S_local, D] -> [B, Hq, S_local, D]; `total_len`
    (optional) is the real full length when `split_for_ring` padded the row (tokens past it are
    masked out both ways and give 0).
    Packed form (`cu_seqlens` given, boundaries in the full packed row): q [T_local, Hq, D],
    k/v [T_local, Hkv, D] -> [T_local, Hq, D]. `group` None: the default group when one is
    initialised, else a single process. `scale` defaults to 1/sqrt(D). `layout` must be the one the
    inputs were split with; `head_stride` is --ring_head_stride (KV heads per ring pass, must divide
    Hkv; None: all); `q_tile` caps the query rows of one fp32 score matrix (math path). `kernel` (KERNELS):
    "auto" (flash / efficient CUDA kernels for fp16/bf16 on a GPU where they work, else "math"), "math"
    (masked fp32 blocks), "blocks" (the rectangle path with the math kernel), "flash", "efficient"."""
    world = _world(group)
    rank = dist.get_rank(group) if world > 1 else 0
    packed = cu_seqlens is not None
    want = 3 if packed else 4
    if q.dim() != want or k.dim() != want or v.dim() != want:
        form = "packed [T, H, D] (cu_seqlens given)" if packed else "padded [B, H, S, D]"
        raise ValueError(f"ring_attention: the {form} form needs {want}-d q, k, v; got {q.dim()}, {k.dim()}, {v.dim()}")
    if packed:
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    b, hq, s, d = q.shape
    hk = k.shape[1]
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"ring_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must match q {tuple(q.shape)} "
                         "except in the number of heads (the packed form is [T, H, D])")
    if hq % hk:
        raise ValueError(f"ring_attention: query heads ({hq}) must be a multiple of key/value heads ({hk})")
    stride = hk if head_stride is None else head_stride
    if not isinstance(stride, int) or stride < 1 or hk % stride:
        raise ValueError(f"--ring_head_stride must be a positive divisor of the key/value heads ({hk}), "
                         f"got {head_stride!r}")
    if q_tile < 1:
        raise ValueError(f"ring_attention: q_tile must be >= 1, got {q_tile}")
    _num_chunks(world, layout)
    pos = [ring_positions(s, r, world, layout, device=q.device) for r in range(world)]
    seg = None
    if cu_seqlens is not None:  # packed
        cu = cu_seqlens.to(device=q.device, dtype=torch.long).flatten()
        if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > s * world:
            raise ValueError(f"cu_seqlens must rise from 0 to at most the packed row's {s * world} tokens, "
                             f"got {cu.tolist()}")
        seg = [torch.where(p < cu[-1], torch.searchsorted(cu, p, right=True) - 1, torch.full_like(p, -1))
               for p in pos]
    elif total_len is not None and not 0 < total_len <= s * world:
        raise ValueError(f"ring_attention: total_len {total_len} is outside 1..{s * world} (S_local x ring size)")
    kern = pick_kernel(kernel, q.device, q.dtype, hq, hk, d)
    bounds = [int(x) for x in cu.tolist()] if packed else [0, s * world if total_len is None else total_len]
    ring = _Ring(group=group, rank=rank, world=world, causal=causal,
                 scale=1.0 / math.sqrt(d) if scale is None else float(scale), head_stride=stride, q_tile=q_tile,
                 acc=torch.promote_types(q.dtype, torch.float32), pos=pos, seg=seg, total_len=total_len,
                 layout=layout, bounds=bounds, kern=kern)
    out = _RingAttention.apply(q, k, v, ring)
    return out.squeeze(0).transpose(0, 1) if packed else out
