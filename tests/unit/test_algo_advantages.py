"""Advantage estimators: values worked out by hand, and GAE against a plain Python loop."""

from __future__ import annotations

import random

import pytest
import torch

from rlhfkit.algo.advantages import AdvantageConfig, compute_advantages
from rlhfkit.algo.returns import discounted_returns, gae_advantages_and_returns
from rlhfkit.algo.shaping import shape_token_rewards

close = torch.testing.assert_close


def test_gae_three_tokens_by_hand() -> None:
    # Row: prompt token, 3 action tokens, pad. gamma = 0.9, lambda = 0.8 (gamma*lambda = 0.72).
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    rho = torch.tensor([[0.0, 0.1, -0.2, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.4, 0.6, 9.0]])  # 9 off the mask must be ignored
    # delta3 = 1.0 + 0.9*0   - 0.6 =  0.4
    # delta2 = -0.2 + 0.9*0.6 - 0.4 = -0.06
    # delta1 = 0.1 + 0.9*0.4 - 0.5 = -0.04
    # A3 = 0.4 ; A2 = -0.06 + 0.72*0.4 = 0.228 ; A1 = -0.04 + 0.72*0.228 = 0.12416
    # R = A + V: 0.62416, 0.628, 1.0
    adv, ret = gae_advantages_and_returns(rho, values, mask, gamma=0.9, lambd=0.8)
    close(adv, torch.tensor([[0.0, 0.12416, 0.228, 0.4, 0.0]]))
    close(ret, torch.tensor([[0.0, 0.62416, 0.628, 1.0, 0.0]]))


def test_gae_skips_env_feedback_holes() -> None:
    # Action tokens at 0, 1 and 4; tokens 2-3 are environment feedback (values there ignored).
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    rho = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 7.0, 7.0, 0.5]])
    # delta(4) = 1 - 0.5 = 0.5 ; delta(1) = 0.9*0.5 - 0.3 = 0.15 ; delta(0) = 0.9*0.3 - 0.2 = 0.07
    # A4 = 0.5 ; A1 = 0.15 + 0.72*0.5 = 0.51 ; A0 = 0.07 + 0.72*0.51 = 0.4372
    adv, ret = gae_advantages_and_returns(rho, values, mask, gamma=0.9, lambd=0.8)
    close(adv, torch.tensor([[0.4372, 0.51, 0.0, 0.0, 0.5]]))
    close(ret, torch.tensor([[0.6372, 0.81, 0.0, 0.0, 1.0]]))


def _gae_loop(rho: list[float], values: list[float], mask: list[int], gamma: float, lambd: float
              ) -> tuple[list[float], list[float]]:
    """Reference: walk the action tokens of one row backwards."""
    steps = [t for t, m in enumerate(mask) if m]
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    last_gae, next_value = 0.0, 0.0
    for t in reversed(steps):
        delta = rho[t] + gamma * next_value - values[t]
        last_gae = delta + gamma * lambd * last_gae
        adv[t], ret[t] = last_gae, last_gae + values[t]
        next_value = values[t]
    return adv, ret


@pytest.mark.parametrize("length,gamma,lambd", [(40, 0.9, 0.8), (40, 1.0, 1.0), (300, 0.99, 0.95), (7, 0.5, 0.0)])
def test_gae_matches_python_loop_on_random_masked_data(length: int, gamma: float, lambd: float) -> None:
    g = torch.Generator().manual_seed(length)
    rng = random.Random(length)
    b = 6
    rho = torch.randn(b, length, generator=g)
    values = torch.randn(b, length, generator=g)
    mask = torch.zeros(b, length, dtype=torch.long)
    for i in range(b - 1):  # the last row stays empty
        start = rng.randrange(0, length // 2)
        end = rng.randrange(start + 1, length + 1)
        mask[i, start:end] = 1
        for _ in range(rng.randrange(0, 3)):  # env-feedback holes
            h = rng.randrange(start, end)
            mask[i, h:h + rng.randrange(1, 4)] = 0
    rho = rho * mask
    adv, ret = gae_advantages_and_returns(rho, values, mask, gamma, lambd)
    for i in range(b):
        a_ref, r_ref = _gae_loop(rho[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lambd)
        close(adv[i], torch.tensor(a_ref), atol=1e-4, rtol=1e-4)
        close(ret[i], torch.tensor(r_ref), atol=1e-4, rtol=1e-4)


def test_reinforce_returns_with_per_token_kl() -> None:
    # 2 samples x 3 tokens, rewards [1, 0], beta = 0.5
    mask = torch.ones(2, 3)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.4, -0.2]])
    # rho row0 = [-0.05, -0.1, 1 - 0.15] = [-0.05, -0.1, 0.85] ; row1 = [0, -0.2, 0.1]
    rho = shape_token_rewards(torch.tensor([1.0, 0.0]), mask, kl=kl, kl_coef=0.5)
    close(rho, torch.tensor([[-0.05, -0.1, 0.85], [0.0, -0.2, 0.1]]))
    # gamma 1: row0 G = [0.70, 0.75, 0.85] ; row1 G = [-0.1, -0.1, 0.1]
    cfg = AdvantageConfig("reinforce", gamma=1.0)
    res = compute_advantages(cfg, torch.tensor([1.0, 0.0]), mask, kl=kl, kl_coef=0.5)
    close(res.returns, torch.tensor([[0.70, 0.75, 0.85], [-0.1, -0.1, 0.1]]))
    # whitening over the 6 tokens: mean = 2.2/6 = 0.366667 ; centred = [0.333333, 0.383333,
    # 0.483333, -0.466667, -0.466667, -0.266667] ; squares sum 0.998333 -> var 0.166389 -> std 0.407908
    centred = torch.tensor([[0.333333, 0.383333, 0.483333], [-0.466667, -0.466667, -0.266667]])
    close(res.advantages, centred / 0.407908, atol=1e-5, rtol=1e-5)
    res2 = compute_advantages(AdvantageConfig("reinforce", no_advantage_std_norm=True),
                              torch.tensor([1.0, 0.0]), mask, kl=kl, kl_coef=0.5)
    close(res2.advantages, centred, atol=1e-5, rtol=1e-5)
    # gamma 0.5 on row0: G2 = 0.85 ; G1 = -0.1 + 0.5*0.85 = 0.325 ; G0 = -0.05 + 0.5*0.325 = 0.1125
    close(discounted_returns(rho, mask, 0.5)[0], torch.tensor([0.1125, 0.325, 0.85]))


def test_reward_goes_to_last_action_token_and_is_clipped() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]])
    rho = shape_token_rewards(torch.tensor([25.0, 3.0]), mask)  # 25 clipped to 10; empty row gets nothing
    close(rho, torch.tensor([[0.0, 0.0, 0.0, 10.0, 0.0], [0.0] * 5]))


def test_reinforce_baseline_centres_groups_then_whitens() -> None:
    # n = 2: groups [1, 0] and [0.5, 0.5] -> baselined [0.5, -0.5, 0, 0]; 2 tokens each, gamma 1
    # returns: row0 [0.5, 0.5], row1 [-0.5, -0.5], rows 2-3 zero
    # whitening: mean 0, var = 4 * 0.25 / 8 = 0.125, std = 0.353553 -> +-0.5/0.353553 = +-sqrt(2)
    cfg = AdvantageConfig("reinforce_baseline", n_samples_per_prompt=2)
    res = compute_advantages(cfg, torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.ones(4, 2))
    close(res.returns, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]))
    s2 = 2 ** 0.5
    close(res.advantages, torch.tensor([[s2, s2], [-s2, -s2], [0.0, 0.0], [0.0, 0.0]]))


def test_rloo_leave_one_out() -> None:
    # n = 3, rewards [1, 0, 2], sum 3: r_i - (3 - r_i)/2 -> [1 - 1, 0 - 1.5, 2 - 0.5] = [0, -1.5, 1.5]
    cfg = AdvantageConfig("rloo", n_samples_per_prompt=3)
    res = compute_advantages(cfg, torch.tensor([1.0, 0.0, 2.0]), torch.ones(3, 1))
    close(res.advantages, torch.tensor([[0.0], [-1.5], [1.5]]))  # no whitening
    # clip after the baseline: --reward_clip_range -1 1 -> [0, -1, 1]
    cfg = AdvantageConfig("rloo", n_samples_per_prompt=3, reward_clip_range=(-1.0, 1.0))
    res = compute_advantages(cfg, torch.tensor([1.0, 0.0, 2.0]), torch.ones(3, 1))
    close(res.advantages, torch.tensor([[0.0], [-1.0], [1.0]]))


def test_group_norm_grpo() -> None:
    # group [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4*0.25/3) = 0.577350 -> +-0.866025
    # group [2, 2, 2, 2]: std 0 -> 0 / (0 + 1e-9) = 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    mask = torch.tensor([[0, 1, 1]] * 8)
    res = compute_advantages(AdvantageConfig("group_norm", n_samples_per_prompt=4), rewards, mask)
    a = 0.866025
    exp = torch.tensor([a, -a, -a, a, 0, 0, 0, 0])[:, None] * mask
    close(res.advantages, exp, atol=1e-6, rtol=1e-6)
    assert abs(res.metrics["group_reward_std"] - 0.577350 / 2) < 1e-6  # mean of [0.57735 x4, 0 x4]
    # with KL in the reward (gamma 1): token t gets r - beta * sum_{k >= t} KL_k
    kl = torch.tensor([[0.0, 1.0, 2.0]] * 8)
    res = compute_advantages(AdvantageConfig("group_norm", n_samples_per_prompt=4), rewards, mask,
                             kl=kl, kl_coef=0.1)
    # row0: token2 = 0.866025 - 0.2 = 0.666025 ; token1 = 0.666025 - 0.1 = 0.566025
    close(res.advantages[0], torch.tensor([0.0, 0.566025, 0.666025]), atol=1e-6, rtol=1e-6)


def test_dr_grpo_keeps_the_scale() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    res = compute_advantages(AdvantageConfig("dr_grpo", n_samples_per_prompt=4), rewards, torch.ones(8, 1))
    # r - group mean: [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    close(res.advantages[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_gae_estimator_shapes_rewards_and_whitens() -> None:
    # the 3-token example again, built from reward 1 and KL [-0.2, 0.4, 0] with beta 0.5:
    # rho = [0.1, -0.2, 1.0] -> A = [0.12416, 0.228, 0.4] ; mean = 0.75216/3 = 0.25072
    # centred = [-0.12656, -0.02272, 0.14928] ; var = (0.0160174 + 0.0005162 + 0.0222845)/3 = 0.0129394
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    kl = torch.tensor([[0.0, -0.2, 0.4, 0.0, 0.0]])
    values = torch.tensor([[0.0, 0.5, 0.4, 0.6, 0.0]])
    cfg = AdvantageConfig("gae", gamma=0.9, lambd=0.8)
    res = compute_advantages(cfg, torch.tensor([1.0]), mask, kl=kl, kl_coef=0.5, values=values)
    std = 0.0129394 ** 0.5
    close(res.advantages, torch.tensor([[0.0, -0.12656 / std, -0.02272 / std, 0.14928 / std, 0.0]]),
          atol=1e-4, rtol=1e-4)
    close(res.returns, torch.tensor([[0.0, 0.62416, 0.628, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(cfg, torch.tensor([1.0]), mask)


@pytest.mark.parametrize("name", ["reinforce_baseline", "rloo", "group_norm", "dr_grpo"])
def test_group_estimators_need_several_samples(name: str) -> None:
    with pytest.raises(ValueError, match="--n_samples_per_prompt"):
        AdvantageConfig(name, n_samples_per_prompt=1)


def test_group_estimators_force_gamma_one_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="--gamma"):
        cfg = AdvantageConfig("rloo", n_samples_per_prompt=2, gamma=0.5)
    res = compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.ones(2, 3))
    close(res.advantages[0], torch.tensor([1.0, 1.0, 1.0]))  # undiscounted


def test_bad_settings_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--advantage_estimator"):
        AdvantageConfig("ppo2")
    with pytest.raises(ValueError, match="--lambd"):
        AdvantageConfig("gae", lambd=1.5)
    with pytest.raises(ValueError, match="--n_samples_per_prompt=3"):
        compute_advantages(AdvantageConfig("rloo", n_samples_per_prompt=3), torch.zeros(4), torch.ones(4, 2))
