"""Extra loss terms added to a task's loss: the MoE router balance loss and PPO-ptx.

Router balance (`--aux_loss_coef`, rlhfkit.models.moe): the model gives one load-balancing loss
per forward pass, a mean over that micro-batch's tokens. Weighting it by the micro-batch's share
of the step's global loss units (tokens, or samples for DPO / KTO),

    L_aux = coef * aux_mb * units_mb / units_step,

makes the sum over micro-batches and ranks coef times the unit-weighted mean of the micro-batch
aux losses, which does not change with micro-batching for a fixed routing, as the main losses.

PPO-ptx (PPO mixed with a pretraining language-modelling loss): `--ptx_coef` times the token
NLL of pretraining text, divided by the step's global count of those tokens (the SFT loss,
rlhfkit.losses.sft), so it is a token mean of the step's pretraining batches whatever the
micro-batching.
"""

from __future__ import annotations

import torch

from rlhfkit.losses.reduce import Count
from rlhfkit.losses.sft import sft_loss

Tensor = torch.Tensor


def router_aux_loss(aux: Tensor, coef: float, units: float, global_units: float) -> tuple[Tensor, dict[str, float]]:
    """`coef * aux * units / global_units`; metric `aux_loss` (this micro-batch's share of the step's
    weighted mean aux loss: summed over micro-batches and ranks it is that mean)."""
    share = float(units) / max(float(global_units), 1e-12)
    return coef * share * aux, {"aux_loss": float(aux.detach()) * share}


def ptx_loss(logprobs: Tensor, loss_mask: Tensor, coef: float, num_tokens: Count) -> tuple[Tensor, dict[str, float]]:
    """`coef` x the SFT loss of pretraining text (`[B, L]` log-probs, global token count);
    metric `ptx_loss` is the (unweighted) SFT loss part, additive over micro-batches and ranks."""
    loss, _ = sft_loss(logprobs, loss_mask, num_tokens, sync_metrics=False)
    return coef * loss, {"ptx_loss": float(loss.detach())}
