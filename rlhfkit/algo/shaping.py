"""Reward shaping: length penalties, reward normalisation, clipping and per-token rewards.

Order in an RL step (OpenRLHF `experience_maker`, see docs/architecture.md):

    scalar rewards r [B]
      -> overlong_penalty / stop_properly_penalty   (before group baselines)
      -> group baseline of the advantage estimator  (algo/advantages.py)
      -> clip to --reward_clip_range, place at the last action token, minus beta * KL_t
         (shape_token_rewards)
      -> returns / advantages                        (algo/returns.py)

Reward normalisation (`--normalize_reward`) uses a mean/std stored with the reward model
(computed by train_rm on its eval set): r <- (r - mean) / std.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def _wide(x: Tensor) -> Tensor:
    """float64 stays float64 (the advantage pipeline runs in it); anything else becomes float32."""
    return x if x.dtype == torch.float64 else x.float()


def _as_tensor(x: Tensor | Sequence[float], like: Tensor | None = None) -> Tensor:
    if isinstance(x, Tensor):
        return x
    device = like.device if like is not None else None
    return torch.as_tensor(list(x), dtype=torch.float32, device=device)


def clip_rewards(rewards: Tensor, clip_range: tuple[float, float] | None) -> Tensor:
    """Clamp scalar rewards to `--reward_clip_range` (lo, hi); None leaves them as they are."""
    if clip_range is None:
        return rewards
    lo, hi = float(clip_range[0]), float(clip_range[1])
    if lo > hi:
        raise ValueError(f"--reward_clip_range low ({lo}) must be <= high ({hi})")
    return rewards.clamp(lo, hi)


def last_action_index(loss_mask: Tensor) -> Tensor:
    """`[B]` index of the last action token of each row; -1 for rows without any."""
    m = loss_mask.bool()
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m, pos, torch.full_like(pos, -1)).max(dim=1).values


def shape_token_rewards(rewards: Tensor, loss_mask: Tensor, *, kl: Tensor | None = None,
                        kl_coef: float = 0.0,
                        clip_range: tuple[float, float] | None = (-10.0, 10.0)) -> Tensor:
    """Per-token rewards rho_t = 1[t = last action] * clip(r) - beta * KL_t, zero off the mask.

    Args:
        rewards: `[B]` scalar rewards, already baseline-adjusted by the estimator.
        loss_mask: `[B, L]` action mask; the reward goes to each row's last action token.
            A row without action tokens gets no reward (it carries no loss either).
        kl: `[B, L]` per-token KL estimate (None: no KL in the reward, e.g. with
            `--use_kl_loss` or without a reference model).
        kl_coef: beta, the current KL coefficient.
        clip_range: `--reward_clip_range`, applied to the scalar before placing it.
    Returns:
        `[B, L]` token rewards, float32 (float64 for float64 rewards).
    """
    if rewards.dim() != 1 or rewards.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"rewards must be [B] = [{loss_mask.shape[0]}], got {tuple(rewards.shape)}")
    r = clip_rewards(_wide(rewards), clip_range)
    mask = loss_mask.to(r.dtype)
    last = last_action_index(loss_mask)
    out = torch.zeros_like(mask)
    has_action = last >= 0
    out[has_action, last[has_action]] = r[has_action]
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * kl.to(r.dtype) * mask
    return out


def overlong_penalty(response_lengths: Tensor | Sequence[int], max_new_tokens: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment: a penalty that grows linearly inside the last L_buf tokens.

    With expected length E = L_max - L_buf (`--max_new_tokens` minus `--overlong_buffer_len`):
        penalty = -min(len - E, L_buf) / L_buf * f   if len > E,   else 0
    (f = `--overlong_penalty_factor`). Returns the `[B]` penalty to add to the rewards.
    """
    if buffer_len <= 0 or buffer_len > max_new_tokens:
        raise ValueError(f"--overlong_buffer_len must be in [1, --max_new_tokens={max_new_tokens}], "
                         f"got {buffer_len}")
    lengths = _as_tensor(response_lengths).float()
    exceed = (lengths - (max_new_tokens - buffer_len)).clamp(min=0.0, max=float(buffer_len))
    return -exceed / buffer_len * penalty_factor


def stop_properly_penalty(rewards: Tensor, truncated: Tensor | Sequence[bool], coef: float) -> Tensor:
    """ProRL penalty for responses cut by the length limit (`--stop_properly_penalty_coef c`).

    For truncated rows (`finish_reason == "length"`): r <- c * r when c >= 0, r <- c when c < 0.
    Other rows keep their reward.
    """
    trunc = _as_tensor(truncated, rewards).to(device=rewards.device).bool()
    if trunc.shape != rewards.shape:
        raise ValueError(f"truncated {tuple(trunc.shape)} must match rewards {tuple(rewards.shape)}")
    new = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(trunc, new, rewards)


def normalize_rewards(rewards: Tensor, mean: float, std: float) -> Tensor:
    """`(r - mean) / std` with the statistics stored by the reward model (`--normalize_reward`)."""
    if not std > 0:
        raise ValueError(f"--normalize_reward needs a stored reward std > 0, got {std}")
    return (rewards - mean) / std


def reward_stats(rewards: Tensor) -> tuple[float, float]:
    """(mean, unbiased std) of a reward sample, the values a reward model stores for normalisation."""
    r = rewards.double().flatten()
    std = r.std().item() if r.numel() > 1 else 0.0
    return r.mean().item(), std
