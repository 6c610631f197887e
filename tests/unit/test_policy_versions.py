"""Per-token policy versions (partial rollout, issue 15 part 2), with values worked out by hand:
the engine's spans, the executors' transcript, and the staleness metrics of the async loop."""

from __future__ import annotations

import pytest

from rlhfkit.agents.executors import Action, Transcript
from rlhfkit.rollout.builtin.loop.scheduler import Sequence
from rlhfkit.trainers.async_queue import staleness_metrics, stamp_versions
from rlhfkit.types import Trajectory


def test_sequence_spans_split_at_the_generated_length():
    seq = Sequence(req=None, sample=0, slot=0, gen_bound=1, spans=[(0, 3)])
    seq.mark_version(3)  # same version: nothing
    seq.gen_bound = 5
    seq.mark_version(4)  # tokens 0..4 came from 3
    seq.mark_version(5)  # an update with no token in between replaces the empty span
    seq.gen_bound = 7
    assert seq.spans == [(0, 3), (5, 5)]
    assert seq.token_versions(7) == [3, 3, 3, 3, 3, 5, 5]
    assert seq.token_versions(4) == [3, 3, 3, 3]  # a completion cut at a stop keeps a prefix
    seq.mark_version(6)  # gen_bound past the end of a finished row: no token of 6
    assert seq.token_versions(7) == [3, 3, 3, 3, 3, 5, 5]


def test_transcript_keeps_versions_of_actions_only():
    tr = Transcript()
    tr.add([1, 2], is_action=False)
    assert tr.policy_versions is None  # no action yet
    tr.add_action(Action([7, 8, 9], [-0.1, -0.2, -0.3], "stop", [0, 0, 1]))
    tr.add([4], is_action=False)
    tr.add_action(Action([5], [-0.5], "length", [1]))
    assert tr.policy_versions == [-1, -1, 0, 0, 1, -1, 1]
    assert tr.logprobs == [0.0, 0.0, -0.1, -0.2, -0.3, 0.0, -0.5]
    tr.add_action(Action([6], [-0.6], "length", None))  # an engine without versions: unknown
    assert tr.policy_versions is None


def traj(mask: list[int], versions: list[int] | None) -> Trajectory:
    return Trajectory(token_ids=list(range(len(mask))), action_mask=mask, rollout_logprobs=[0.0] * len(mask),
                      prompt_len=mask.index(1), policy_versions=versions)


def test_staleness_per_trajectory_and_per_token():
    a = traj([0, 1, 1, 1, 1], [-1, 2, 2, 3, 3])  # started under 2, finished under 3 (partial rollout)
    b = traj([0, 0, 1, 1], [-1, -1, 3, 3])
    c = traj([0, 1, 1], None)  # no per-token versions: the batch's version for each token
    stamp_versions([a, b, c], batch_version=2)
    assert [t.policy_version for t in (a, b, c)] == [2, 3, 2]
    m = staleness_metrics([a, b, c], trained=4)
    assert m["staleness"] == pytest.approx((2 + 1 + 2) / 3) and m["staleness_max"] == 2.0
    # tokens: a 2,2,1,1  b 1,1  c 2,2
    assert m["staleness_token_mean"] == pytest.approx(12 / 8) and m["staleness_token_max"] == 2.0
    assert m["mixed_version_samples"] == pytest.approx(1 / 3)
    assert staleness_metrics([], 4)["staleness"] == 0.0
