"""Length penalties, reward normalisation, dynamic filtering and pass@k: values by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algo.filters import dynamic_filter, group_passes
from rlhfkit.algo.passk import pass_at_k, pass_at_k_from_scores
from rlhfkit.algo.shaping import normalize_rewards, overlong_penalty, reward_stats, stop_properly_penalty

close = torch.testing.assert_close


def test_dapo_overlong_penalty() -> None:
    # L_max = 20, L_buf = 4 -> expected length 16 ; factor 0.5
    # len 10, 16 -> 0 ; 17 -> -1/4*0.5 = -0.125 ; 18 -> -2/4*0.5 = -0.25 ; 20 -> -0.5 ; 25 -> capped -0.5
    pen = overlong_penalty(torch.tensor([10, 16, 17, 18, 20, 25]), max_new_tokens=20, buffer_len=4,
                           penalty_factor=0.5)
    close(pen, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match="--overlong_buffer_len"):
        overlong_penalty([5], max_new_tokens=20, buffer_len=30)


def test_stop_properly_penalty() -> None:
    r = torch.tensor([1.0, 0.8, -0.5])
    trunc = [True, False, True]
    close(stop_properly_penalty(r, trunc, 0.5), torch.tensor([0.5, 0.8, -0.25]))  # c >= 0: multiply
    close(stop_properly_penalty(r, trunc, -1.0), torch.tensor([-1.0, 0.8, -1.0]))  # c < 0: replace


def test_reward_normalisation() -> None:
    close(normalize_rewards(torch.tensor([2.0, 6.0, -2.0]), mean=2.0, std=4.0), torch.tensor([0.0, 1.0, -1.0]))
    # [1, 3]: mean 2, unbiased std sqrt(2)
    mean, std = reward_stats(torch.tensor([1.0, 3.0]))
    assert mean == 2.0 and math.isclose(std, math.sqrt(2))
    with pytest.raises(ValueError, match="--normalize_reward"):
        normalize_rewards(torch.tensor([1.0]), 0.0, 0.0)


def test_dynamic_filtering_keeps_groups_strictly_inside_the_range() -> None:
    # n = 4; group means: 1.0, 0.25, 0.0, 0.75
    scores = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1], dtype=torch.float)
    res = dynamic_filter(scores, 4, (0.0, 1.0))
    assert res.kept_groups.tolist() == [1, 3]
    assert res.kept_rows.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert res.pass_rate == 0.5
    # (0.3, 1.0): 0.25 out, 0.75 in, 1.0 out (strict)
    res = dynamic_filter(scores, 4, (0.3, 1.0))
    assert res.kept_groups.tolist() == [3] and res.pass_rate == 0.25
    assert group_passes(torch.tensor([0.0, 1.0])) and not group_passes(torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="--n_samples_per_prompt"):
        dynamic_filter(scores, 1)
    with pytest.raises(ValueError, match="--dynamic_filtering_reward_range"):
        dynamic_filter(scores, 4, (1.0, 0.0))


def test_pass_at_k_by_hand() -> None:
    # n = 5, c = 2: pass@1 = 1 - C(3,1)/C(5,1) = 1 - 3/5 = 0.4
    assert math.isclose(pass_at_k(5, 2, 1), 0.4)
    assert math.isclose(pass_at_k(5, 2, 2), 0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert math.isclose(pass_at_k(5, 2, 3), 0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 4) == 1.0  # n - c = 3 < 4
    assert pass_at_k(5, 0, 3) == 0.0
    for n in range(1, 12):  # the product form equals the binomial form
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert math.isclose(pass_at_k(n, c, k), exact, abs_tol=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_at_k_from_scores() -> None:
    # prompt 1: c = 1 of 4 -> 1 - C(3,2)/C(4,2) = 0.5 ; prompt 2: c = 2 -> 1 - 1/6 ; mean 0.666667
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert math.isclose(pass_at_k_from_scores(scores, 4, 2), (0.5 + 5 / 6) / 2)
    assert math.isclose(pass_at_k_from_scores(scores, 4, 1), 3 / 8)
