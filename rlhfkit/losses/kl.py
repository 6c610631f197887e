"""KL penalty as a loss term (`--use_kl_loss`, GRPO style: added to the loss, not the reward).

Recomputed at every training micro-step with the *current* policy against the reference:

    L_KL = aggregate_t k(log pi - log pi_ref)

with k one of the estimators of `rlhfkit.algo.kl` (`--kl_estimator`, k2 or k3 recommended
as a loss), clamped to [-10, 10], aggregated like the policy loss (token level over the
global token count by default). The caller adds beta * L_KL (beta = `--init_kl_coef`).
"""

from __future__ import annotations

import torch

from rlhfkit.algo.kl import compute_approx_kl
from rlhfkit.losses.reduce import TOKEN, Count, aggregate, finish_metrics, local_mean

Tensor = torch.Tensor


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, *, estimator: str = "k3",
            num_tokens: Count = None, num_sequences: Count = None,
            loss_agg: str = TOKEN, sync_metrics: bool = True) -> tuple[Tensor, dict[str, float]]:
    """Unscaled KL loss of one micro-batch (`[B, L]` inputs).

    Metrics: `kl_loss` (the returned value) and `kl` (local masked mean of the estimate)."""
    kl = compute_approx_kl(logprobs, ref_logprobs, estimator, mask=loss_mask)
    loss = aggregate(kl, loss_mask, loss_agg, num_tokens=num_tokens, num_sequences=num_sequences)
    return loss, finish_metrics({"kl_loss": loss.detach(), "kl": local_mean(kl, loss_mask)}, sync_metrics)
