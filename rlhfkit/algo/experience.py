"""Experience making: trajectories -> a padded `ExperienceBatch` with rewards and advantages.

    trajectories --pad--> input_ids/attention_mask/loss_mask/rollout_logprobs [B, L], rewards [B]
    + old/ref log-probs, values (filled by the loop from the roles)
    --length penalties, KL (k1/k2/k3 of old vs ref), estimator--> advantages, returns [B, L]

Pure torch; the rows of one prompt are contiguous (group estimators rely on it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.algo.advantages import AdvantageConfig, compute_advantages
from rlhfkit.algo.kl import compute_approx_kl
from rlhfkit.algo.shaping import overlong_penalty, stop_properly_penalty
from rlhfkit.config.declare import default_of
from rlhfkit.config.rl_flags import RewardSourceFlags
from rlhfkit.types import ExperienceBatch, Trajectory


def pad_trajectories(trajs: list[Trajectory], pad_id: int, no_loss_ids: tuple[int, ...] = ()) -> ExperienceBatch:
    """Right-pad trajectories into `[B, L]` tensors; `rewards` holds each one's scalar reward.
    Tokens in `no_loss_ids` (a VLM's picture placeholders and markers) never enter the loss;
    trajectories with pictures give `images`, one entry per row."""
    if not trajs:
        raise ValueError("no trajectories to train on")
    L = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    rlp = torch.zeros((B, L), dtype=torch.float32)
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids, dtype=torch.long)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(t.action_mask, dtype=torch.long)
        if t.rollout_logprobs:
            rlp[i, :n] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    mask[:, 0] = 0  # token 0 is never predicted
    for t in no_loss_ids:
        mask[ids == t] = 0
    rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32)
    images = [t.images for t in trajs] if any(t.images is not None for t in trajs) else None
    return ExperienceBatch(input_ids=ids, attention_mask=attn, loss_mask=mask, rollout_logprobs=rlp,
                           rewards=rewards, images=images)


@dataclass
class RewardShapingConfig:
    """[--generate_max_len], [--overlong_buffer_len], [--overlong_penalty_factor], [--stop_properly_penalty_coef];
    the penalties' defaults are their flags' declared ones, `generate_max_len`'s the value train_ppo resolves an
    unset --generate_max_len to (without --max_len)."""

    generate_max_len: int = 1024
    overlong_buffer_len: int | None = default_of(RewardSourceFlags, "overlong_buffer_len")
    overlong_penalty_factor: float = default_of(RewardSourceFlags, "overlong_penalty_factor")
    stop_properly_penalty_coef: float | None = default_of(RewardSourceFlags, "stop_properly_penalty_coef")


def apply_length_penalties(rewards: torch.Tensor, response_lengths: torch.Tensor, truncated: torch.Tensor,
                           cfg: RewardShapingConfig) -> torch.Tensor:
    """DAPO's soft overlong penalty and ProRL's truncation penalty on scalar rewards `[B]`."""
    out = rewards.float()
    if cfg.overlong_buffer_len:
        out = out + overlong_penalty(response_lengths, cfg.generate_max_len, cfg.overlong_buffer_len,
                                     cfg.overlong_penalty_factor)
    if cfg.stop_properly_penalty_coef is not None:
        out = stop_properly_penalty(out, truncated, cfg.stop_properly_penalty_coef)
    return out


def finish_experience(batch: ExperienceBatch, adv_cfg: AdvantageConfig, kl_coef: float, kl_estimator: str,
                      kl_in_reward: bool, reduce=None) -> tuple[ExperienceBatch, dict[str, float]]:
    """Fill `advantages` and `returns` (and a per-token KL into the reward when `kl_in_reward`)."""
    mask = batch.loss_mask.float()
    kl = None
    metrics: dict[str, float] = {}
    if batch.ref_logprobs is not None and batch.old_logprobs is None and kl_in_reward and kl_coef != 0:
        raise ValueError("a KL penalty in the reward needs the old log-probs before training")
    if batch.ref_logprobs is not None and batch.old_logprobs is not None:  # else the policy reports it
        kl_all = compute_approx_kl(batch.old_logprobs, batch.ref_logprobs, kl_estimator, mask=batch.loss_mask)
        metrics["kl"] = float((kl_all * mask).sum() / mask.sum().clamp(min=1))
        if kl_in_reward:
            kl = kl_all
    res = compute_advantages(adv_cfg, batch.rewards, batch.loss_mask, kl=kl, kl_coef=kl_coef if kl_in_reward else 0.0,
                             values=batch.values, reduce=reduce)
    batch.advantages, batch.returns = res.advantages, res.returns
    metrics.update({k: v for k, v in res.metrics.items() if k != "kl"})
    return batch, metrics
