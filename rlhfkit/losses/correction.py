"""Rollout-engine vs trainer importance-sampling correction (TIS / ICEPOP / seq-mask-TIS).

The engine samples from pi_rollout, which differs slightly from the trainer's pi_old
(kernels, precision). With w_t = exp(log pi_old - log pi_rollout) and the band [lo, hi]
(`--vllm_is_truncated_threshold LOW HIGH`, default 0.5 5.0), the per-token policy loss is
multiplied by a detached weight (`--vllm_is_correction_type`):

    tis           clamp(w_t, lo, hi)                       truncated IS (weights clipped to the
                                                           band)
    icepop        w_t * 1[lo <= w_t <= hi]                 tokens outside the band dropped
                                                           (IcePop)
    seq-mask-tis  w_t * 1[lo <= s <= hi],                  whole row dropped unless its geometric
                  s = exp(mean_t log w_t)                  mean ratio is in the band

`IS_CORRECTIONS` maps the names to weight functions; add an entry to add a variant.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlhfkit.losses.reduce import local_mean

Tensor = torch.Tensor
LOG_RATIO_CLAMP = 20.0


def _log_w(old_logprobs: Tensor, rollout_logprobs: Tensor) -> Tensor:
    return (old_logprobs.float() - rollout_logprobs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def tis_weights(log_w: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    """Truncated importance weights clamp(w, lo, hi)."""
    return log_w.exp().clamp(lo, hi)


def icepop_weights(log_w: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    """w where lo <= w <= hi, else 0."""
    w = log_w.exp()
    return w * ((w >= lo) & (w <= hi)).to(w.dtype)


def seq_mask_tis_weights(log_w: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    """Unclamped w on rows whose geometric-mean ratio exp(mean_t log w_t) is in [lo, hi], else 0."""
    m = mask.to(log_w.dtype)
    seq = ((log_w * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).exp()
    keep = ((seq >= lo) & (seq <= hi)).to(log_w.dtype)
    return log_w.exp() * keep[:, None]


IS_CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float, float], Tensor]] = {
    "tis": tis_weights,
    "icepop": icepop_weights,
    "seq-mask-tis": seq_mask_tis_weights,
}


def check_is_correction(kind: str, threshold: tuple[float, float]) -> None:
    if kind not in IS_CORRECTIONS:
        raise ValueError(f"--vllm_is_correction_type {kind!r} is not one of {sorted(IS_CORRECTIONS)}")
    lo, hi = threshold
    if not 0 <= lo <= hi:
        raise ValueError(f"--vllm_is_truncated_threshold needs 0 <= LOW <= HIGH, got {lo} {hi}")


def is_correction_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, kind: str = "tis",
                          threshold: tuple[float, float] = (0.5, 5.0)) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached `[B, L]` weights for the token loss, zero off the mask, and metrics.

    Metrics (local masked means): `vllm_kl` = mean(log pi_rollout - log pi_old),
    `is_weight` (mean weight) and `is_dropped_ratio` (fraction of tokens given weight 0).
    """
    check_is_correction(kind, threshold)
    lo, hi = float(threshold[0]), float(threshold[1])
    log_w = _log_w(old_logprobs, rollout_logprobs).detach()
    w = IS_CORRECTIONS[kind](log_w, mask, lo, hi) * mask.to(log_w.dtype)
    metrics = {
        "vllm_kl": local_mean(rollout_logprobs.float() - old_logprobs.float(), mask),
        "is_weight": local_mean(w, mask),
        "is_dropped_ratio": local_mean((w == 0).float(), mask),
    }
    return w.detach(), metrics
