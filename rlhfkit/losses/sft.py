"""Supervised fine-tuning loss: token negative log-likelihood.

    L = -sum_{b,t} m_bt log p(x_bt | x_<bt) / num_tokens

over the response tokens (`loss_mask`; all tokens in pretrain mode), divided by the global
token count of the optimizer step (losses/reduce.py), so that the sum of micro-batch losses
is the token mean of the whole step. Metrics: `nll_sum` (this micro-batch's summed NLL, for
exact logging after an all-reduce), `num_tokens` (its token count), `nll` (its token mean).
"""

from __future__ import annotations

import torch

from rlhfkit.losses.reduce import Count, finish_metrics, token_sum_over

Tensor = torch.Tensor


def sft_loss(logprobs: Tensor, loss_mask: Tensor, num_tokens: Count = None, sync_metrics: bool = True
             ) -> tuple[Tensor, dict[str, float]]:
    """Token NLL from `[B, L]` log-probs of the target tokens (aligned with `loss_mask`)."""
    if logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    nll = -logprobs.float()
    loss = token_sum_over(nll, loss_mask, num_tokens)
    m = loss_mask.float()
    nll_sum = (nll.detach() * m).sum()
    count = m.sum()
    return loss, finish_metrics({"nll_sum": nll_sum, "num_tokens": count, "nll": nll_sum / count.clamp(min=1.0)},
                                sync_metrics)
