"""Batch whitening over data-parallel shards equals whitening of the whole batch."""

import torch

from rlhfkit.algo.masked import whiten


def test_whiten_with_reduce_over_two_shards_equals_full_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).long()
    full = whiten(x, mask)
    a, b = slice(0, 2), slice(2, 6)

    def stats(xs, ms):
        xf, mf = xs.double(), ms.double()
        return torch.stack([(xf * mf).sum(), (xf * xf * mf).sum(), mf.sum()])

    # a fake all-reduce: this shard's stats + the other shard's
    ra = whiten(x[a], mask[a], reduce=lambda s: s + stats(x[b], mask[b]))
    rb = whiten(x[b], mask[b], reduce=lambda s: s + stats(x[a], mask[a]))
    torch.testing.assert_close(torch.cat([ra, rb]), full, rtol=1e-5, atol=1e-6)
    # without the reduction each shard is whitened on its own and differs
    assert not torch.allclose(whiten(x[a], mask[a]), full[a], atol=1e-3)


def test_whiten_matches_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, biased var 2/3 -> (x - 2) / sqrt(2/3)
    expect = torch.tensor([[-1.0, 0.0, 1.0, 0.0]]) / (2.0 / 3.0) ** 0.5
    torch.testing.assert_close(whiten(x, mask), expect)
    torch.testing.assert_close(whiten(x, mask, scale=False), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
