"""The rectangle path of ring attention in one process (rlhfkit/parallel/ring_blocks.py): the FULL /
CAUSAL rectangles of every (rank, src) block of fake rings of 1, 2 and 4 cover exactly the mask the
math path builds (`_Ring.plan`), for random packings with padding, both layouts, causal or not and the
padded form; the rectangle driver with the math kernel equals the math path (values and gradients,
GQA, head_stride, packed with padding); kernel selection on the CPU. Real rings:
tests/distributed/test_ring_attention.py; the CUDA kernels: tests/gpu/test_ring_flash.py."""

from __future__ import annotations

import random

import pytest
import torch

from rlhfkit.parallel.ring_attention import _Ring, ring_attention, ring_positions
from rlhfkit.parallel.ring_blocks import (
    CAUSAL,
    FULL,
    MathKernel,
    block_rectangles,
    pick_kernel,
)


def fake_ring(world, rank, s, layout, causal, cu=None, total_len=None):
    pos = [ring_positions(s, r, world, layout) for r in range(world)]
    seg = None
    if cu is not None:
        cut = torch.tensor(cu)
        seg = [torch.where(p < cut[-1], torch.searchsorted(cut, p, right=True) - 1, torch.full_like(p, -1))
               for p in pos]
    return _Ring(group=None, rank=rank, world=world, causal=causal, scale=1.0, head_stride=1, q_tile=4096,
                 acc=torch.float32, pos=pos, seg=seg, total_len=total_len)


def plan_mask(ring, src, s):
    full = torch.zeros(s, s, dtype=torch.bool)
    plan = ring.plan(src)
    if plan is not None:
        qs, ks, sub = plan
        full[qs, ks] = True if sub is None else sub
    return full


def rect_mask(rects, s):
    full = torch.zeros(s, s, dtype=torch.int32)
    for qs, ks, kind in rects:
        assert kind in (FULL, CAUSAL)
        if kind == CAUSAL:
            assert qs.stop - qs.start == ks.stop - ks.start
            block = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.int32).tril()
        else:
            block = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.int32)
        full[qs, ks] += block
    assert int(full.max()) <= 1, "rectangles overlap"
    return full.bool()


def random_cu(total, rng):
    real = rng.randint(1, total)
    cuts = sorted(rng.sample(range(1, real), k=min(rng.randint(0, 5), real - 1))) if real > 1 else []
    return [0, *cuts, real]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_rectangles_cover_the_mask(world, layout):
    rng = random.Random(world * 10 + len(layout))
    for trial in range(12):
        s = 2 * rng.randint(1, 9)
        total = s * world
        causal = trial % 3 != 2
        packed = trial % 4 != 3
        cu = random_cu(total, rng) if packed else None
        total_len = None if packed else rng.randint(1, total)
        bounds = cu if packed else [0, total_len]
        for rank in range(world):
            ring = fake_ring(world, rank, s, layout, causal, cu, total_len)
            for src in range(world):
                want = plan_mask(ring, src, s)
                got = rect_mask(block_rectangles(s, rank, src, world, layout, causal, bounds), s)
                assert torch.equal(got, want), (world, layout, causal, cu, total_len, rank, src)


def test_rectangles_by_hand():
    # ring of 2, zig-zag, 8 tokens (c = 2): rank 0 holds positions 0,1 | 6,7, rank 1 holds 2,3 | 4,5;
    # sequences [0, 3) and [3, 7), position 7 is padding
    cu = [0, 3, 7]
    own = block_rectangles(4, 0, 0, 2, "zigzag", True, cu)
    assert own == [(slice(0, 2), slice(0, 2), CAUSAL),  # 0,1 x 0,1
                   (slice(2, 3), slice(2, 3), CAUSAL)]  # 6 x 6 (7 is padding)
    other = block_rectangles(4, 0, 1, 2, "zigzag", True, cu)
    assert other == [(slice(2, 3), slice(1, 2), FULL),  # 6 sees 3 (2 is the first sequence)
                     (slice(2, 3), slice(2, 4), FULL)]  # 6 sees 4,5
    assert block_rectangles(4, 1, 0, 2, "zigzag", True, cu) == [(slice(0, 1), slice(0, 2), FULL)]  # 2 sees 0,1


def test_math_kernel_contract():
    torch.manual_seed(0)
    q, k, v, do = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 4, 5, 8)
    kern = MathKernel()
    out, lse = kern.forward(q, k, v, True, 0.3)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-6)
    assert torch.allclose(out, torch.softmax(s, -1) @ vr, atol=1e-6)
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, kr, vr))
    ref = torch.softmax((qa @ ka.transpose(-1, -2) * 0.3).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1),
                                                                         float("-inf")), -1) @ va
    gq, gk, gv = torch.autograd.grad(ref, (qa, ka, va), do)
    dq, dk, dv = kern.backward(do, q, k, v, out, lse, True, 0.3)
    assert torch.allclose(dq, gq, atol=1e-5)
    assert torch.allclose(dk, gk.view(1, 2, 2, 5, 8).sum(2), atol=1e-5)
    assert torch.allclose(dv, gv.view(1, 2, 2, 5, 8).sum(2), atol=1e-5)


@pytest.mark.parametrize("case", ["packed", "padded", "noncausal_stride1"])
def test_blocks_equal_math_in_one_process(case):
    torch.manual_seed(1)
    hq, hk, d = 6, 3, 8
    kw = {"causal": case != "noncausal_stride1", "head_stride": 1 if case == "noncausal_stride1" else None}
    if case == "padded":
        shape_q, shape_kv = (2, hq, 14, d), (2, hk, 14, d)
        kw["total_len"] = 11
    else:
        shape_q, shape_kv = (20, hq, d), (20, hk, d)
        kw["cu_seqlens"] = torch.tensor([0, 4, 5, 13, 17], dtype=torch.int32)  # 3 padding tokens
    inputs = [torch.randn(*sh) for sh in (shape_q, shape_kv, shape_kv)]
    g_out = torch.randn(*shape_q)
    res = {}
    for kernel in ("math", "blocks"):
        x = [t.clone().requires_grad_(True) for t in inputs]
        out = ring_attention(*x, kernel=kernel, **kw)
        res[kernel] = [out.detach(), *torch.autograd.grad(out, x, g_out)]
    for a, b in zip(res["math"], res["blocks"]):
        assert (a - b).abs().max() < 1e-6 * max(1.0, float(a.abs().max()))


def test_kernel_choice_on_cpu():
    cpu = torch.device("cpu")
    assert pick_kernel("auto", cpu, torch.bfloat16, 4, 2, 64) is None  # the math path
    assert isinstance(pick_kernel("blocks", cpu, torch.float32, 4, 2, 64), MathKernel)
    with pytest.raises(ValueError, match="not usable here"):
        pick_kernel("flash", cpu, torch.bfloat16, 4, 2, 64)
    with pytest.raises(ValueError, match="kernel must be one of"):
        pick_kernel("fast", cpu, torch.float32, 4, 2, 64)
