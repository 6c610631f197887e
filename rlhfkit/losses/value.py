"""Critic loss with PPO value clipping (`--value_clip c`, default 0.5).

    V_clip = V_old + clamp(V - V_old, -c, c)
    L_t    = 1/2 * max((V - R)^2, (V_clip - R)^2)       (1/2 (V - R)^2 when c is None)

token-level aggregated over the global action-token count (losses/reduce.py). R are the
GAE returns of algo/returns.py, V_old the critic's values at experience time. Metrics (local
means): `critic_loss`, `values`, `value_clip_ratio` (the clipped term is the larger one).
"""

from __future__ import annotations

import torch

from rlhfkit.losses.reduce import Count, finish_metrics, local_mean, token_sum_over

Tensor = torch.Tensor


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, *,
               value_clip: float | None = 0.5, num_tokens: Count = None, sync_metrics: bool = True
               ) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss of one micro-batch (all inputs `[B, L]`)."""
    if value_clip is not None and value_clip < 0:
        raise ValueError(f"--value_clip must be >= 0, got {value_clip}")
    v, r = values.float(), returns.float()
    err = (v - r) ** 2
    metrics: dict[str, Tensor | float] = {}
    if value_clip is None:
        per_token = 0.5 * err
    else:
        v_old = old_values.float()
        err_clip = (v_old + (v - v_old).clamp(-value_clip, value_clip) - r) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        metrics["value_clip_ratio"] = local_mean((err_clip > err).float(), loss_mask)
    loss = token_sum_over(per_token, loss_mask, num_tokens)
    metrics = {"critic_loss": loss.detach(), "values": local_mean(v, loss_mask), **metrics}
    return loss, finish_metrics(metrics, sync_metrics)
