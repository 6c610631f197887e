"""Numerics of the advantage estimators and the dynamic filter against float64 references of the
same formulas (issue 14, part 6): inputs where float32 statistics go wrong.

- REINFORCE++ with every reward 1 and a small KL: returns near 1 with a small spread, where the
  one-pass float32 variance E[x^2] - mean^2 cancels; also over two ranks.
- group statistics of equal fractional rewards (0.9, 0.9, 0.9): advantages exactly 0.
- group_passes and dynamic_filter: the same decision as the float64 mean, at the bounds.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algo.advantages import AdvantageConfig, compute_advantages
from rlhfkit.algo.filters import dynamic_filter, group_passes
from test_algo_whiten_reduce import FakeWorld, run_ranks

TOL = 1e-5


def reinforce_case(b: int = 64, length: int = 48, seed: int = 0):
    """All rewards 1, per-token KL in [0, 0.01), beta 0.01; each row a random action span."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, length, dtype=torch.long)
    for i in range(b):
        s = int(torch.randint(2, 10, (1,), generator=g))
        mask[i, s:int(torch.randint(s + 1, length + 1, (1,), generator=g))] = 1
    return torch.ones(b), mask, torch.rand(b, length, generator=g) * 0.01, 0.01


def reinforce_reference(rewards, mask, kl, beta):
    """Python float64 loops: rho_t = clip(r) at the last action - beta * KL_t; G_t = sum_{k >= t} rho_k
    over action tokens (gamma 1); whitened by the masked mean and biased variance (>= 1e-8)."""
    b, length = mask.shape
    out = torch.zeros(b, length, dtype=torch.float64)
    for i in range(b):
        acts = [t for t in range(length) if mask[i, t]]
        acc = 0.0
        for t in reversed(acts):
            acc += -beta * float(kl[i, t]) + (min(max(float(rewards[i]), -10.0), 10.0) if t == acts[-1] else 0.0)
            out[i, t] = acc
    vals = [float(out[i, t]) for i in range(b) for t in range(length) if mask[i, t]]
    mean = math.fsum(vals) / len(vals)
    var = max(math.fsum((v - mean) ** 2 for v in vals) / len(vals), 1e-8)
    return (out - mean) / math.sqrt(var) * mask.double()


def one_pass_float32_whiten(x, mask):
    """The formula this replaces: float32 sums, variance as E[x^2] - mean^2."""
    m = mask.float()
    s1, s2, n = (x * m).sum().double(), (x * x * m).sum().double(), m.sum().double()
    mean = s1 / n
    return (x - mean.float()) * ((s2 / n - mean * mean).clamp(min=1e-8)).rsqrt().float() * m


def test_reinforce_all_rewards_one_small_kl_matches_float64():
    rewards, mask, kl, beta = reinforce_case()
    ref = reinforce_reference(rewards, mask, kl, beta)
    res = compute_advantages(AdvantageConfig("reinforce"), rewards, mask, kl=kl, kl_coef=beta)
    assert res.advantages.dtype == torch.float32
    assert (res.advantages.double() - ref).abs().max().item() < TOL
    # the input is a hard one: the old one-pass float32 whitening of the same returns is far off
    old = one_pass_float32_whiten(res.returns, mask)
    assert (old.double() - ref).abs().max().item() > 100 * TOL


def test_reinforce_whitening_over_two_ranks_matches_float64():
    rewards, mask, kl, beta = reinforce_case(seed=1)
    ref = reinforce_reference(rewards, mask, kl, beta)
    cfg, cut = AdvantageConfig("reinforce"), 24
    parts = [slice(0, cut), slice(cut, None)]
    outs = run_ranks(FakeWorld(2), [
        lambda red, p=p: compute_advantages(cfg, rewards[p], mask[p], kl=kl[p], kl_coef=beta, reduce=red).advantages
        for p in parts])
    assert (torch.cat(outs).double() - ref).abs().max().item() < TOL


def group_reference(rewards: list[float], n: int, kind: str) -> list[float]:
    """float64 group formulas; a group whose values are all equal gets 0."""
    out = []
    for g in range(0, len(rewards), n):
        grp = rewards[g:g + n]
        mean = math.fsum(grp) / n
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in grp) / (n - 1))
        for i, r in enumerate(grp):
            if len(set(grp)) == 1:
                out.append(0.0)
            elif kind == "group_norm":
                out.append((r - mean) / (std + 1e-9))
            elif kind == "rloo":
                out.append(r - (math.fsum(grp) - r) / (n - 1))
            else:
                out.append(r - mean)
    return out


@pytest.mark.parametrize("kind", ["group_norm", "rloo", "dr_grpo"])
def test_group_statistics_match_float64_and_equal_groups_give_zero(kind):
    # as the trainer hands them over: float32 rewards
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.1, 0.5, 0.9, 1.0, 0.0, 1.0, 0.3, 0.3, 0.3], dtype=torch.float32)
    mask = torch.ones(12, 1)
    res = compute_advantages(AdvantageConfig(kind, n_samples_per_prompt=3), rewards, mask)
    ref = torch.tensor(group_reference([float(r) for r in rewards], 3, kind), dtype=torch.float64)
    assert (res.advantages[:, 0].double() - ref).abs().max().item() < TOL
    assert torch.equal(res.advantages[[0, 1, 2, 9, 10, 11], 0], torch.zeros(6))  # exactly 0, not 0.81


def test_equal_group_of_09_is_zero_and_has_zero_std():
    res = compute_advantages(AdvantageConfig("group_norm", n_samples_per_prompt=3),
                             torch.tensor([0.9, 0.9, 0.9]), torch.ones(3, 2))
    assert torch.equal(res.advantages, torch.zeros(3, 2)) and res.metrics["group_reward_std"] == 0.0


@pytest.mark.parametrize("scores, bounds", [
    ([0.3, 0.3], (0.3, 1.0)),      # float32(0.3) = 0.30000001 > 0.3: passed in one helper, not the other
    ([0.7, 0.7], (0.0, 0.7)),      # float32(0.7) = 0.69999999 < 0.7
    ([0.0, 1.0], (0.0, 1.0)),
    ([1.0, 1.0], (0.0, 1.0)),
])
def test_group_passes_and_dynamic_filter_agree_with_the_float64_mean(scores, bounds):
    lo, hi = bounds
    expect = lo < math.fsum(scores) / len(scores) < hi
    t = torch.tensor(scores, dtype=torch.float64)
    assert group_passes(t, bounds) is expect
    kept = dynamic_filter(t, len(scores), bounds).kept_groups.tolist()
    assert kept == ([0] if expect else [])
