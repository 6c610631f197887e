"""Advantage estimators, registered by `--advantage_estimator` name.

Rows of a batch are grouped by prompt: rows `[g*n, (g+1)*n)` are the n =
`--n_samples_per_prompt` samples of prompt g (the experience maker keeps this order).

| name                 | scalar transform of r_i in its group  | token returns           | whitening |
| -------------------- | ------------------------------------- | ----------------------- | --------- |
| gae (PPO)            | none                                  | GAE with critic values  | yes       |
| reinforce (REINFORCE++)| none                                | discounted reward-to-go | yes       |
| reinforce_baseline   | r_i - mean_j r_j                      | reward-to-go, gamma = 1 | yes       |
| rloo                 | r_i - sum_{j != i} r_j / (n - 1)      | reward-to-go, gamma = 1 | no        |
| group_norm (GRPO)    | (r_i - mean) / (std + 1e-9)           | reward-to-go, gamma = 1 | no        |
| dr_grpo (Dr. GRPO)   | r_i - mean                            | reward-to-go, gamma = 1 | no        |

The transformed scalar is clipped to `--reward_clip_range` and placed at the last action
token, minus beta * KL_t on every action token (`shape_token_rewards`). Whitening is masked
over every action token of the batch (`--no_advantage_std_norm`: centre only). Group
estimators use gamma = 1 whatever `--gamma` says (a warning is emitted) and need n > 1.

Numerics: `compute_advantages` runs in float64 (group statistics, shaping, returns, two-pass
whitening) and hands back float32, so the result matches a float64 evaluation of the same
formulas within float32 rounding. A group whose rewards are equal up to a relative
`EQUAL_GROUP_RTOL` (spread <= rtol * max |r|) has a zero baseline-adjusted reward and a zero
std: float rounding of the mean must not turn (0.9, 0.9, 0.9) into advantages of 0.81.

Adding an estimator: write `fn(inputs: AdvantageInputs, cfg: AdvantageConfig) ->
(advantages, returns)` from the helpers here and decorate it with
`@register_advantage_estimator("name", group=..., needs_critic=...)`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from rlhfkit.algo.masked import masked_mean, whiten
from rlhfkit.algo.returns import discounted_returns, gae_advantages_and_returns
from rlhfkit.algo.shaping import shape_token_rewards
from rlhfkit.config.declare import default_of
from rlhfkit.config.rl_flags import AlgoFlags, RewardSourceFlags, RolloutFlags

Tensor = torch.Tensor

# Rewards reach the estimators as float32 (relative step 6e-8 to 1.2e-7); a group spread within a
# few of those steps of its largest |reward| is rounding, not signal.
EQUAL_GROUP_RTOL = 1e-6


@dataclass
class AdvantageConfig:
    """`--advantage_estimator`, `--gamma`, `--lambd`, `--n_samples_per_prompt`,
    `--no_advantage_std_norm`, `--reward_clip_range`; each default is its flag's declared one."""

    advantage_estimator: str = default_of(AlgoFlags, "advantage_estimator")
    gamma: float = default_of(AlgoFlags, "gamma")
    lambd: float = default_of(AlgoFlags, "lambd")
    n_samples_per_prompt: int = default_of(RolloutFlags, "n_samples_per_prompt")
    no_advantage_std_norm: bool = default_of(AlgoFlags, "no_advantage_std_norm")
    reward_clip_range: tuple[float, float] | None = default_of(RewardSourceFlags, "reward_clip_range", convert=tuple)

    def __post_init__(self) -> None:
        spec = get_advantage_estimator(self.advantage_estimator)
        for name, v in (("--gamma", self.gamma), ("--lambd", self.lambd)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if spec.group and self.n_samples_per_prompt <= 1:
            raise ValueError(f"--advantage_estimator {self.advantage_estimator} compares samples of the same "
                             f"prompt and needs --n_samples_per_prompt > 1 "
                             f"(got {self.n_samples_per_prompt}; every advantage would be 0)")
        if spec.group and self.gamma != 1.0:
            warnings.warn(f"--advantage_estimator {self.advantage_estimator} uses gamma = 1; "
                          f"--gamma {self.gamma} is ignored", stacklevel=2)


@dataclass
class AdvantageInputs:
    """What an estimator sees. Shapes: B rows, L tokens.

    rewards: `[B]` scalar rewards after length penalties, before any group baseline (float64 when
    called from `compute_advantages`).
    loss_mask: `[B, L]` action mask. kl: `[B, L]` per-token KL or None. kl_coef: beta.
    values: `[B, L]` critic values (gae only) or None. n: samples per prompt.
    """

    rewards: Tensor
    loss_mask: Tensor
    kl: Tensor | None = None
    kl_coef: float = 0.0
    values: Tensor | None = None
    n: int = 1
    clip_range: tuple[float, float] | None = (-10.0, 10.0)
    reduce: Callable[[Tensor], Tensor] | None = None  # sums over ranks (batch whitening)

    def token_rewards(self, scalar: Tensor) -> Tensor:
        """`[B, L]` shaped rewards: clip(scalar) at the last action token minus beta * KL."""
        return shape_token_rewards(scalar, self.loss_mask, kl=self.kl, kl_coef=self.kl_coef,
                                   clip_range=self.clip_range)


EstimatorFn = Callable[[AdvantageInputs, AdvantageConfig], "tuple[Tensor, Tensor]"]


@dataclass(frozen=True)
class AdvantageEstimator:
    fn: EstimatorFn
    group: bool = False  # compares samples of one prompt: needs n > 1, gamma forced to 1
    needs_critic: bool = False  # reads critic values


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, *, group: bool = False,
                                 needs_critic: bool = False) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator adding `fn` to `ADVANTAGE_ESTIMATORS` under `name`."""
    def deco(fn: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(fn, group, needs_critic)
        return fn
    return deco


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage_estimator {name!r} is not one of {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


# ----------------------------------------------------------------------------- group baselines


def _groups(rewards: Tensor, n: int) -> Tensor:
    """`[G, n]` float64 view of the rewards (group statistics are taken in float64)."""
    if rewards.dim() != 1 or rewards.numel() % n != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of "
                         f"--n_samples_per_prompt={n} (rows of one prompt must be contiguous)")
    return rewards.double().view(-1, n)


def equal_groups(g: Tensor, rtol: float = EQUAL_GROUP_RTOL) -> Tensor:
    """`[G, 1]` bool: the group's spread (max - min) is <= rtol * its largest |reward|."""
    spread = g.amax(dim=1, keepdim=True) - g.amin(dim=1, keepdim=True)
    return spread <= rtol * g.abs().amax(dim=1, keepdim=True)


def _zero_equal(g: Tensor, value: Tensor) -> Tensor:
    """`value` `[G, n]` with the rows of equal groups set to exactly 0, flattened to `[B]`."""
    return torch.where(equal_groups(g), torch.zeros_like(value), value).flatten()


def group_mean_baseline(rewards: Tensor, n: int) -> Tensor:
    """r_i - mean of its group (REINFORCE++-baseline, Dr. GRPO: no division by the std)."""
    g = _groups(rewards, n)
    return _zero_equal(g, g - g.mean(dim=1, keepdim=True))


def leave_one_out_baseline(rewards: Tensor, n: int) -> Tensor:
    """RLOO (REINFORCE leave-one-out): r_i - sum_{j != i} r_j / (n - 1)."""
    g = _groups(rewards, n)
    return _zero_equal(g, g - (g.sum(dim=1, keepdim=True) - g) / (n - 1))


def group_norm_baseline(rewards: Tensor, n: int, eps: float = 1e-9) -> Tensor:
    """GRPO (group-normalised rewards): (r_i - mean) / (std + eps), unbiased std;
    0 for a group of equal rewards (`equal_groups`)."""
    g = _groups(rewards, n)
    return _zero_equal(g, (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps))


def group_reward_std(rewards: Tensor, n: int) -> Tensor:
    """`[B]` unbiased std of each row's group (logged as `group_reward_std`); 0 for equal groups."""
    g = _groups(rewards, n)
    return _zero_equal(g, g.std(dim=1, keepdim=True).expand_as(g))


# ----------------------------------------------------------------------------- estimators


def _whiten(adv: Tensor, inp: AdvantageInputs, cfg: AdvantageConfig) -> Tensor:
    return whiten(adv, inp.loss_mask, scale=not cfg.no_advantage_std_norm, reduce=inp.reduce)


@register_advantage_estimator("gae", needs_critic=True)
def gae_estimator(inp: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """PPO (RLHF with a critic): GAE on KL-shaped rewards with critic values, then whitening."""
    if inp.values is None:
        raise ValueError("--advantage_estimator gae needs critic values (a critic model)")
    adv, ret = gae_advantages_and_returns(inp.token_rewards(inp.rewards), inp.values,
                                          inp.loss_mask, cfg.gamma, cfg.lambd)
    return _whiten(adv, inp, cfg), ret


@register_advantage_estimator("reinforce")
def reinforce_estimator(inp: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (no critic): discounted return of shaped rewards, whitened."""
    ret = discounted_returns(inp.token_rewards(inp.rewards), inp.loss_mask, cfg.gamma)
    return _whiten(ret, inp, cfg), ret


def _group_returns(inp: AdvantageInputs, scalar: Tensor) -> Tensor:
    return discounted_returns(inp.token_rewards(scalar), inp.loss_mask, 1.0)


@register_advantage_estimator("reinforce_baseline", group=True)
def reinforce_baseline_estimator(inp: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: group-mean baseline, reward-to-go (gamma 1), batch whitening."""
    ret = _group_returns(inp, group_mean_baseline(inp.rewards, inp.n))
    return _whiten(ret, inp, cfg), ret


@register_advantage_estimator("rloo", group=True)
def rloo_estimator(inp: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """RLOO: leave-one-out baseline, reward-to-go (gamma 1), no whitening."""
    ret = _group_returns(inp, leave_one_out_baseline(inp.rewards, inp.n))
    return ret, ret


@register_advantage_estimator("group_norm", group=True)
def group_norm_estimator(inp: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """GRPO: group-normalised reward, reward-to-go (gamma 1), no whitening."""
    ret = _group_returns(inp, group_norm_baseline(inp.rewards, inp.n))
    return ret, ret


ADVANTAGE_ESTIMATORS["grpo"] = ADVANTAGE_ESTIMATORS["group_norm"]  # the same estimator under GRPO's name


@register_advantage_estimator("dr_grpo", group=True)
def dr_grpo_estimator(inp: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: group-mean baseline without std division, reward-to-go (gamma 1), no whitening."""
    ret = _group_returns(inp, group_mean_baseline(inp.rewards, inp.n))
    return ret, ret


# ----------------------------------------------------------------------------- entry point


@dataclass
class AdvantageResult:
    """advantages, returns: `[B, L]` float32, zero off the mask; metrics: rollout statistics
    (`reward`, `return`, `advantage`, and `group_reward_std` / `kl` when they apply)."""

    advantages: Tensor
    returns: Tensor
    metrics: dict[str, float]


def compute_advantages(cfg: AdvantageConfig, rewards: Tensor, loss_mask: Tensor, *,
                       kl: Tensor | None = None, kl_coef: float = 0.0,
                       values: Tensor | None = None,
                       reduce: Callable[[Tensor], Tensor] | None = None) -> AdvantageResult:
    """Advantages and returns of a whole rollout with the estimator named in `cfg`.

    Args:
        cfg: the estimator settings.
        rewards: `[B]` scalar rewards after length penalties (rows of a prompt contiguous).
        loss_mask: `[B, L]` action mask.
        kl: `[B, L]` per-token KL for reward shaping (None with `--use_kl_loss` / no ref model).
        kl_coef: the KL controller's current beta.
        values: `[B, L]` critic values, needed by `gae`.
        reduce: sums a tensor over data-parallel ranks, so batch whitening uses the global batch.
    """
    if loss_mask.dim() != 2 or loss_mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"loss_mask must be [B, L] with B = {rewards.shape[0]}, got {tuple(loss_mask.shape)}")
    spec = get_advantage_estimator(cfg.advantage_estimator)
    n = cfg.n_samples_per_prompt
    wide = [None if t is None else t.double() for t in (rewards, kl, values)]  # see "Numerics" above
    inp = AdvantageInputs(wide[0], loss_mask, wide[1], kl_coef, wide[2], n, cfg.reward_clip_range, reduce)
    adv, ret = spec.fn(inp, cfg)
    adv, ret = adv.float(), ret.float()
    stats = [rewards.double().mean(), masked_mean(ret, loss_mask), masked_mean(adv, loss_mask)]
    names = ["reward", "return", "advantage"]
    if spec.group or (n > 1 and rewards.numel() % n == 0):
        stats.append(group_reward_std(rewards, n).mean())
        names.append("group_reward_std")
    if kl is not None:
        stats.append(masked_mean(kl, loss_mask))
        names.append("kl")
    values_f = torch.stack([s.float() for s in stats]).tolist()
    return AdvantageResult(adv, ret, dict(zip(names, values_f)))
