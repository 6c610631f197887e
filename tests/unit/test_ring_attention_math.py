"""Ring attention in one process (rlhfkit/parallel/ring_attention.py): the online-softmax merge worked
out by hand, the zig-zag split and its inverse, each rank's view of the causal mask across blocks in
a fake ring of 4, a group of one against float64 attention (gradcheck in float64), packed rows, and
the errors for bad shapes and strides. The real ring (2 and 4 ranks over gloo) is
tests/distributed/test_ring_attention.py."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.parallel.ring_attention import (
    _block_forward,
    _Ring,
    cu_seqlens_from_position_ids,
    merge_attention,
    padded_length,
    ring_attention,
    ring_positions,
    split_for_ring,
    unsplit_ring,
)

INF = float("inf")


def test_merge_by_hand():
    # one query; keys of part a score 0 and ln 3 (values 2, 6), the key of part b scores ln 4 (value 10)
    out_a, lse_a = torch.tensor([[(1 * 2 + 3 * 6) / 4.0]]), torch.tensor([math.log(4)])
    out_b, lse_b = torch.tensor([[10.0]]), torch.tensor([math.log(4)])
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    # all three keys at once: weights 1, 3, 4 over 8 -> (2 + 18 + 40) / 8
    assert out.item() == pytest.approx(7.5)
    assert lse.item() == pytest.approx(math.log(8))
    # merging is symmetric
    out2, lse2 = merge_attention(out_b, lse_b, out_a, lse_a)
    assert out2.item() == pytest.approx(7.5) and lse2.item() == pytest.approx(math.log(8))


def test_merge_with_empty_parts():
    out_a, lse_a = torch.tensor([[3.0], [0.0]]), torch.tensor([0.5, -INF])
    empty, no = torch.zeros(2, 1), torch.full((2,), -INF)
    out, lse = merge_attention(out_a, lse_a, empty, no)  # a part that saw no key changes nothing
    assert out.tolist() == [[3.0], [0.0]] and lse[0].item() == pytest.approx(0.5) and lse[1].item() == -INF
    assert not torch.isnan(out).any()


def test_block_forward_scores_by_hand():
    # q = (1, 0), keys (ln2, 0) and (0, 0): scores ln2 and 0 (scale 1) -> weights 2/3, 1/3
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 1, 2)
    k = torch.tensor([[math.log(2), 0.0], [0.0, 0.0]]).view(1, 1, 2, 2)
    v = torch.tensor([[3.0, 0.0], [0.0, 6.0]]).view(1, 1, 2, 2)
    out, lse = _block_forward(q, k, v, None, 1.0)
    assert out.flatten().tolist() == pytest.approx([2.0, 2.0])
    assert lse.item() == pytest.approx(math.log(3))
    out, lse = _block_forward(q, k, v, torch.tensor([[False, False]]), 1.0)  # a row that sees nothing
    assert out.flatten().tolist() == [0.0, 0.0] and lse.item() == -INF


def test_zigzag_split_and_back():
    x = torch.arange(13).view(1, 13)
    assert padded_length(13, 2) == 16 and padded_length(13, 2, "contiguous") == 14
    # 16 tokens in 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; padding is -1
    r0 = split_for_ring(x, 0, 2, dim=1, pad_value=-1)
    r1 = split_for_ring(x, 1, 2, dim=1, pad_value=-1)
    assert r0.tolist() == [[0, 1, 2, 3, 12, -1, -1, -1]]
    assert r1.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert ring_positions(8, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert torch.equal(unsplit_ring([r0, r1], dim=1, length=13), x)
    c = [split_for_ring(x, r, 2, dim=1, layout="contiguous") for r in range(2)]
    assert c[1].tolist() == [[7, 8, 9, 10, 11, 12, 0]]
    assert torch.equal(unsplit_ring(c, dim=1, layout="contiguous", length=13), x)


def _fake_ring(rank: int, world: int = 4, local: int = 4) -> _Ring:
    pos = [ring_positions(local, r, world) for r in range(world)]
    return _Ring(group=None, rank=rank, world=world, causal=True, scale=1.0, head_stride=1, q_tile=64,
                 acc=torch.float32, pos=pos, seg=None, total_len=None)


def test_causal_blocks_across_a_fake_ring():
    # ring of 4, 16 tokens, chunks of 2: rank 1 holds positions 2, 3 | 12, 13
    ring = _fake_ring(1)
    # an earlier rank (0: positions 0, 1 | 14, 15): every query sees its first half whole, none its second
    assert ring.plan(0) == (slice(0, 4), slice(0, 2), None)
    # a later rank (2: positions 4, 5 | 10, 11): only the second half of the queries, seeing all its keys
    assert ring.plan(2) == (slice(2, 4), slice(0, 4), None)
    # its own block: causal inside it
    qs, ks, mask = ring.plan(1)
    assert (qs, ks) == (slice(0, 4), slice(0, 4))
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [True, True, True, False], [True, True, True, True]]
    # every rank computes the same number of query-key pairs (the zig-zag balance)
    work = []
    for r in range(4):
        ring = _fake_ring(r)
        n = 0
        for src in range(4):
            plan = ring.plan(src)
            if plan is not None:
                qs, ks, mask = plan
                n += int(mask.sum()) if mask is not None else (qs.stop - qs.start) * (ks.stop - ks.start)
        work.append(n)
    assert work == [34, 34, 34, 34]  # 16 * 17 / 2 = 136 visible pairs, a quarter each


def _reference(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -INF)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("causal", [True, False])
def test_one_process_equals_full_attention(causal):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = _reference(q, k, v, causal)
    out = ring_attention(q, k, v, causal=causal, layout="contiguous", head_stride=1, q_tile=3)
    assert (out - ref).abs().max() < 1e-12
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert (a - b).abs().max() < 1e-12
    small = [t.detach()[:1, :, :5].clone().requires_grad_(True) for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *t: ring_attention(*t, causal=causal, layout="contiguous"), small)


def test_packed_is_each_sequence_alone():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(10, 2, 4, generator=gen, requires_grad=True) for _ in range(3))
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3, 0, 1, 2])
    cu = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 7, 10]
    out = ring_attention(q, k, v, cu_seqlens=cu, layout="contiguous")
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        sl = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        want = _reference(*sl, True).squeeze(0).transpose(0, 1)
        assert (out[a:b] - want).abs().max() < 1e-6
    # the first token of the second sequence sees only itself: its output is its own value
    assert torch.allclose(out[3], v[3], atol=1e-6)


def test_bad_inputs_name_the_problem():
    q, kv = torch.zeros(1, 4, 4, 2), torch.zeros(1, 2, 4, 2)
    with pytest.raises(ValueError, match="--ring_head_stride"):
        ring_attention(q, kv, kv, head_stride=3)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ring_attention(torch.zeros(1, 3, 4, 2), kv, kv)
    with pytest.raises(ValueError, match=r"packed \[T, H, D\]"):
        ring_attention(q, kv, kv, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        ring_attention(q[0].transpose(0, 1), kv[0].transpose(0, 1), kv[0].transpose(0, 1),
                       cu_seqlens=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="layout"):
        split_for_ring(q, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="start each sequence at 0"):
        cu_seqlens_from_position_ids(torch.tensor([1, 2, 0]))
