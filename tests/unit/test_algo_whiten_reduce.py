"""Batch whitening over data-parallel shards equals whitening of the whole batch.

The shards run in two threads whose `reduce` is a real sum over both (a barrier-based fake
all-reduce), so the test holds for any number of reductions whitening makes."""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from rlhfkit.algo.masked import whiten


class FakeWorld:
    """`reducer(rank)` sums a tensor over `n` threads, like `all_reduce_sum` over n ranks."""

    def __init__(self, n: int) -> None:
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=30)
        self.calls = 0

    def reducer(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.calls += rank == 0
            self.barrier.wait()
            return total
        return reduce


def run_ranks(world: FakeWorld, fns):
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result() for f in [pool.submit(fn, world.reducer(r)) for r, fn in enumerate(fns)]]


def test_whiten_with_reduce_over_two_shards_equals_full_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).long()
    full = whiten(x, mask)
    a, b = slice(0, 2), slice(2, 6)
    world = FakeWorld(2)
    ra, rb = run_ranks(world, [lambda red: whiten(x[a], mask[a], reduce=red),
                               lambda red: whiten(x[b], mask[b], reduce=red)])
    assert world.calls == 2  # two passes: the mean, then the squared deviations from it
    torch.testing.assert_close(torch.cat([ra, rb]), full, rtol=1e-6, atol=1e-6)
    # without the reduction each shard is whitened on its own and differs
    assert not torch.allclose(whiten(x[a], mask[a]), full[a], atol=1e-3)


def test_whiten_matches_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, biased var 2/3 -> (x - 2) / sqrt(2/3)
    expect = torch.tensor([[-1.0, 0.0, 1.0, 0.0]]) / (2.0 / 3.0) ** 0.5
    torch.testing.assert_close(whiten(x, mask), expect)
    torch.testing.assert_close(whiten(x, mask, scale=False), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    assert whiten(x.bfloat16(), mask).dtype == torch.bfloat16
