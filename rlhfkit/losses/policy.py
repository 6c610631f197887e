"""Policy-gradient losses: PPO clipped surrogate (clip-higher, dual clip) and GSPO.

PPO (clipped surrogate objective), per action token t:

    r_t = exp(clamp(log pi - log pi_old, -20, 20))
    L_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

* clip-higher (DAPO): eps_high > eps_low (`--eps_clip_low_high 0.2 0.28`).
* dual clip, c > 1 (`--dual_clip c`): for A_t < 0 the
  objective is max(min(r A, clip(r) A), c A), which bounds the loss of a huge ratio.
* GSPO (group sequence policy optimization), `--policy_loss_type gspo`: the ratio is the
  sequence's geometric mean s_i = exp(mean_t (log pi - log pi_old)) for every token of row
  i, and the loss is a sequence-level mean. With IS correction on, GSPO takes its ratio
  against the rollout engine's log-probs and no token weight is applied.
* IS correction (losses/correction.py): the token loss is multiplied by a detached weight.
* Entropy bonus (`--entropy_loss_coef`): loss -= coef * aggregate(entropy).

Aggregation (losses/reduce.py): token level over the global token count by default,
sequence level over the global row count for GSPO or `loss_agg="seq"`.
Metrics (local means over action tokens): `ppo_clip_ratio` (the clipped branch is the
active one), `ppo_kl` = mean(log pi_old - log pi), `dual_clip_ratio`, `vllm_kl` (when
rollout log-probs are given), `entropy`, `policy_loss`.
`POLICY_LOSSES` maps `--policy_loss_type` names to their log-ratio function and default
aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlhfkit.config.declare import default_of
from rlhfkit.config.rl_flags import AlgoFlags
from rlhfkit.losses.correction import check_is_correction, is_correction_weights
from rlhfkit.losses.reduce import AGGREGATIONS, SEQUENCE, TOKEN, Count, aggregate, local_mean, to_floats
from rlhfkit.types import ExperienceBatch

Tensor = torch.Tensor
LOG_RATIO_CLAMP = 20.0


def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """PPO: per-token log pi - log pi_old, clamped to [-20, 20]."""
    return (logprobs.float() - old_logprobs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO: each row's mean log-ratio over its action tokens, broadcast to `[B, L]`."""
    m = mask.float()
    diff = (logprobs.float() - old_logprobs.float()) * m
    seq = diff.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[:, None].expand_as(diff)


@dataclass(frozen=True)
class PolicyLossType:
    log_ratio: Callable[[Tensor, Tensor, Tensor], Tensor]
    default_agg: str = TOKEN
    sequence_is: bool = False  # IS correction replaces pi_old by pi_rollout in the ratio


POLICY_LOSSES: dict[str, PolicyLossType] = {
    "ppo": PolicyLossType(token_log_ratio, TOKEN),
    "gspo": PolicyLossType(sequence_log_ratio, SEQUENCE, sequence_is=True),
}


@dataclass
class PolicyLossConfig:
    """`--policy_loss_type`, `--eps_clip` / `--eps_clip_low_high`, `--dual_clip`,
    `--enable_vllm_is_correction` + `--vllm_is_correction_type` (is_correction; None: off),
    `--vllm_is_truncated_threshold`, `--entropy_loss_coef`. loss_agg None: the type's default."""

    policy_loss_type: str = default_of(AlgoFlags, "policy_loss_type")
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: float | None = default_of(AlgoFlags, "dual_clip")
    is_correction: str | None = None
    is_threshold: tuple[float, float] = (0.5, 5.0)
    entropy_coef: float | None = None
    loss_agg: str | None = None

    def __post_init__(self) -> None:
        if self.policy_loss_type not in POLICY_LOSSES:
            raise ValueError(f"--policy_loss_type {self.policy_loss_type!r} is not one of {sorted(POLICY_LOSSES)}")
        if self.eps_clip_low < 0 or self.eps_clip_high < 0 or self.eps_clip_low >= 1:
            raise ValueError(f"--eps_clip_low_high needs 0 <= low < 1 and high >= 0, "
                             f"got {self.eps_clip_low} {self.eps_clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"--dual_clip must be > 1, got {self.dual_clip}")
        if self.is_correction is not None:
            check_is_correction(self.is_correction, self.is_threshold)
        if self.loss_agg is not None and self.loss_agg not in AGGREGATIONS:
            raise ValueError(f"loss_agg {self.loss_agg!r} is not one of {AGGREGATIONS}")

    @classmethod
    def from_flags(cls, *, policy_loss_type: str = "ppo", eps_clip: float = 0.2,
                   eps_clip_low_high: tuple[float, float] | list[float] | None = None,
                   dual_clip: float | None = None, enable_vllm_is_correction: bool = False,
                   vllm_is_correction_type: str = "tis",
                   vllm_is_truncated_threshold: tuple[float, float] | list[float] = (0.5, 5.0),
                   entropy_loss_coef: float | None = None) -> "PolicyLossConfig":
        """Build from the RL flag values (keyword names = flag dests); `--eps_clip_low_high`
        defaults to (`--eps_clip`, `--eps_clip`)."""
        low, high = eps_clip_low_high if eps_clip_low_high is not None else (eps_clip, eps_clip)
        lo, hi = vllm_is_truncated_threshold
        return cls(policy_loss_type=policy_loss_type, eps_clip_low=float(low), eps_clip_high=float(high),
                   dual_clip=dual_clip, is_correction=vllm_is_correction_type if enable_vllm_is_correction else None,
                   is_threshold=(float(lo), float(hi)), entropy_coef=entropy_loss_coef)

    @property
    def aggregation(self) -> str:
        return self.loss_agg or POLICY_LOSSES[self.policy_loss_type].default_agg


def clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                      dual_clip: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token loss -min(r A, clip(r) A) (dual-clipped for A < 0); also the masks
    `clipped` (clip branch active) and `dual` (dual-clip bound active)."""
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    obj = torch.minimum(surr1, surr2)
    clipped = surr2 < surr1
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        bound = dual_clip * advantages
        dual = (advantages < 0) & (bound > obj)
        obj = torch.where(dual, bound, obj)
    return -obj, clipped, dual


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
                cfg: PolicyLossConfig | None = None, *, num_tokens: Count = None,
                num_sequences: Count = None, rollout_logprobs: Tensor | None = None,
                entropy: Tensor | None = None, sync_metrics: bool = True
                ) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy loss of one micro-batch (all tensors `[B, L]`).

    Args:
        logprobs: log pi of the taken tokens (with grad).
        old_logprobs: log pi_old from experience making.
        advantages: per-token advantages.
        loss_mask: 1 on action tokens.
        cfg: loss settings (default: PPO, eps 0.2, no dual clip, no IS correction).
        num_tokens: global action-token count of the optimizer step (token aggregation).
        num_sequences: global count of non-empty rows of the step (sequence aggregation).
        rollout_logprobs: the engine's log-probs (IS correction; `vllm_kl` metric).
        entropy: per-token entropy of pi (with grad), for the bonus and the metric.
        sync_metrics: False returns the metrics as 0-d tensors on the loss's device (no host sync, so
            the next micro-batch's kernels queue behind this one's; the caller converts once per step).
    """
    cfg = cfg or PolicyLossConfig()
    kind = POLICY_LOSSES[cfg.policy_loss_type]
    use_is = cfg.is_correction is not None
    if use_is and rollout_logprobs is None:
        raise ValueError("--enable_vllm_is_correction needs the rollout engine's log-probs (rollout_logprobs)")
    base = rollout_logprobs if (use_is and kind.sequence_is) else old_logprobs
    ratio = kind.log_ratio(logprobs, base, loss_mask).exp()
    tok_loss, clipped, dual = clipped_surrogate(ratio, advantages.float(), cfg.eps_clip_low,
                                                cfg.eps_clip_high, cfg.dual_clip)
    metrics: dict[str, Tensor | float] = {
        "ppo_clip_ratio": local_mean(clipped.float(), loss_mask),
        "ppo_kl": local_mean(old_logprobs.float() - logprobs.float(), loss_mask),
    }
    if cfg.dual_clip is not None:
        metrics["dual_clip_ratio"] = local_mean(dual.float(), loss_mask)
    if rollout_logprobs is not None:
        if use_is and not kind.sequence_is:
            w, is_metrics = is_correction_weights(old_logprobs, rollout_logprobs, loss_mask,
                                                  cfg.is_correction, cfg.is_threshold)  # type: ignore[arg-type]
            tok_loss = tok_loss * w
            metrics.update(is_metrics)
        else:
            metrics["vllm_kl"] = local_mean(rollout_logprobs.float() - old_logprobs.float(), loss_mask)
    agg = cfg.aggregation
    loss = aggregate(tok_loss, loss_mask, agg, num_tokens=num_tokens, num_sequences=num_sequences)
    metrics["policy_loss"] = loss.detach()
    if entropy is not None:
        metrics["entropy"] = local_mean(entropy.float(), loss_mask)
    if cfg.entropy_coef is not None and cfg.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("--entropy_loss_coef is set but no entropy was passed to policy_loss")
        loss = loss - cfg.entropy_coef * aggregate(entropy.float(), loss_mask, agg, num_tokens=num_tokens,
                                                   num_sequences=num_sequences)
    if not sync_metrics:
        return loss, metrics  # type: ignore[return-value]
    return loss, to_floats(metrics)


def policy_loss_on_batch(logprobs: Tensor, batch: ExperienceBatch, cfg: PolicyLossConfig | None = None,
                         entropy: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """`policy_loss` with the tensors and global counts of an `ExperienceBatch`
    (`num_loss_tokens` for token aggregation, `num_samples` for sequence aggregation)."""
    if batch.old_logprobs is None or batch.advantages is None:
        raise ValueError("policy_loss_on_batch needs batch.old_logprobs and batch.advantages")
    return policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, cfg,
                       num_tokens=batch.num_loss_tokens, num_sequences=batch.num_samples,
                       rollout_logprobs=batch.rollout_logprobs, entropy=entropy)
