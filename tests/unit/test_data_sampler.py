"""Resumable sampler: resume == uninterrupted, 2-rank sharding covers each global batch disjointly."""

from __future__ import annotations

import pytest

from rlhfkit.data.sampler import ResumableDistributedSampler as Sampler


def run(samplers, epochs, stop_after=None):
    """Iterate all ranks in lock step; return per-rank (epoch, index) lists and states at the stop."""
    seen = [[] for _ in samplers]
    start = samplers[0].epoch
    for ep in range(start, epochs):
        for s in samplers:
            s.set_epoch(ep)
        for step, idxs in enumerate(zip(*samplers)):
            for r, i in enumerate(idxs):
                seen[r].append((ep, i))
            if stop_after is not None and len(seen[0]) == stop_after:
                return seen, [s.state_dict() for s in samplers]
    return seen, None


@pytest.mark.parametrize("stop_after", [1, 5, 11, 12, 13, 30])
def test_resume_equals_uninterrupted(stop_after):
    # 25 samples, 2 ranks, drop_last -> 12 per rank per epoch; 12 and 24 stop at an epoch end
    make = lambda: [Sampler(25, world_size=2, rank=r, seed=3) for r in range(2)]  # noqa: E731
    full, _ = run(make(), epochs=3)
    first, states = run(make(), epochs=3, stop_after=stop_after)
    resumed = make()
    for s, st in zip(resumed, states):
        s.load_state_dict(st)
    rest, _ = run(resumed, epochs=3)
    assert [a + b for a, b in zip(first, rest)] == full


def test_two_ranks_split_each_global_batch():
    n, mbs = 24, 3
    ranks = [Sampler(n, world_size=2, rank=r, seed=1) for r in range(2)]
    order = ranks[0].global_order()
    streams = [list(s) for s in ranks]
    assert sorted(streams[0] + streams[1]) == list(range(n))  # disjoint cover of the dataset
    for k in range(n // (2 * mbs)):  # global batch k = order[6k:6k+6]
        per_rank = [set(st[k * mbs:(k + 1) * mbs]) for st in streams]
        assert per_rank[0].isdisjoint(per_rank[1])
        assert per_rank[0] | per_rank[1] == set(order[k * 2 * mbs:(k + 1) * 2 * mbs])


def test_epochs_seed_and_padding():
    s = Sampler(10, seed=0)
    e0 = list(s)
    assert list(s) == e0  # a finished epoch iterated again replays it
    s.set_epoch(1)
    e1 = list(s)
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    assert list(Sampler(10, seed=0)) == e0 and list(Sampler(10, seed=1)) != e0
    assert list(Sampler(5, shuffle=False)) == [0, 1, 2, 3, 4]
    # no drop_last: 5 samples on 2 ranks -> padded by wrapping around to 6 positions
    padded = [list(Sampler(5, world_size=2, rank=r, shuffle=False, drop_last=False)) for r in range(2)]
    assert padded == [[0, 2, 4], [1, 3, 0]]
    assert [list(Sampler(5, world_size=2, rank=r, shuffle=False)) for r in range(2)] == [[0, 2], [1, 3]]


def test_resume_on_another_world_size():
    one = Sampler(12, world_size=1, seed=5)
    it = iter(one)
    taken = [next(it) for _ in range(4)]
    two = [Sampler(12, world_size=2, rank=r, seed=5) for r in range(2)]
    for s in two:
        s.load_state_dict(one.state_dict())
    rest = [list(s) for s in two]
    assert sorted(taken + rest[0] + rest[1]) == list(range(12))
    assert rest[0] == one.global_order()[4::2] and rest[1] == one.global_order()[5::2]


def test_refuses_mismatched_checkpoint():
    s = Sampler(10, seed=0)
    with pytest.raises(ValueError, match="num_samples=11"):
        s.load_state_dict({"epoch": 0, "consumed": 0, "num_samples": 11, "seed": 0})
    with pytest.raises(ValueError, match="not a multiple of the world size 2"):
        Sampler(10, world_size=2).load_state_dict({"epoch": 0, "consumed": 3})
