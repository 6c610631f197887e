"""Direct preference losses on summed response log-probs: DPO, cDPO and IPO.

With z = (log pi(y_c) - log pi(y_r)) - (log pi_ref(y_c) - log pi_ref(y_r)), log-probs summed
over each response's tokens, and beta = `--beta` (default 0.1):

    DPO  (direct preference optimization):   -log sigmoid(beta z)
    cDPO (conservative DPO, for noisy preference labels), eps = `--label_smoothing`:
         -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)
    IPO  (identity preference optimization), `--ipo`:   (z - 1 / (2 beta))^2

Each pair's loss is summed and divided by the global pair count of the step. An optional
NLL term (`--nll_loss_coef`, Llama 3.1 / RPO style) adds coef * sum_b nll_b / num_samples,
where nll_b is the per-token mean NLL of chosen response b. Metrics (local means):
`chosen_reward` = beta (log pi(y_c) - log pi_ref(y_c)), `rejected_reward`, `accuracy`
(chosen reward > rejected reward), `margin` (chosen - rejected reward), `preference_loss`,
`nll_loss` (when given).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhfkit.losses.reduce import Count, finish_metrics, sample_sum_over

Tensor = torch.Tensor


def _check(beta: float, label_smoothing: float, ipo: bool) -> None:
    if beta <= 0:
        raise ValueError(f"--beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"--label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if ipo and label_smoothing > 0:
        raise ValueError("--label_smoothing (cDPO) cannot be combined with --ipo")


def preference_pair_losses(z: Tensor, beta: float, label_smoothing: float = 0.0, ipo: bool = False) -> Tensor:
    """`[B]` per-pair DPO / cDPO / IPO losses from the log-ratio difference z `[B]`."""
    if ipo:
        return (z - 1.0 / (2.0 * beta)) ** 2
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
             ref_rejected_logps: Tensor, *, beta: float = 0.1, label_smoothing: float = 0.0,
             ipo: bool = False, num_samples: Count = None, chosen_nll: Tensor | None = None,
             nll_loss_coef: float = 0.0, sync_metrics: bool = True) -> tuple[Tensor, dict[str, float]]:
    """DPO / cDPO / IPO loss of one micro-batch of pairs.

    Args:
        chosen_logps, rejected_logps: `[B]` summed response log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: `[B]` the same under the reference model.
        beta, label_smoothing, ipo: `--beta`, `--label_smoothing`, `--ipo`.
        num_samples: global pair count of the optimizer step.
        chosen_nll: `[B]` per-token mean NLL of each chosen response (for `--nll_loss_coef`).
        nll_loss_coef: weight of the NLL term.
    """
    _check(beta, label_smoothing, ipo)
    pc, pr = chosen_logps.float(), rejected_logps.float()
    rc, rr = ref_chosen_logps.float(), ref_rejected_logps.float()
    z = (pc - pr) - (rc - rr)
    pref = sample_sum_over(preference_pair_losses(z, beta, label_smoothing, ipo), num_samples)
    loss = pref
    chosen_r = beta * (pc - rc).detach()
    rejected_r = beta * (pr - rr).detach()
    metrics: dict[str, Tensor | float] = {
        "preference_loss": pref.detach(),
        "chosen_reward": chosen_r.mean(),
        "rejected_reward": rejected_r.mean(),
        "accuracy": (chosen_r > rejected_r).float().mean(),
        "margin": (chosen_r - rejected_r).mean(),
    }
    if nll_loss_coef != 0.0:
        if chosen_nll is None:
            raise ValueError("--nll_loss_coef is set but no chosen_nll was passed to dpo_loss")
        nll = sample_sum_over(chosen_nll, num_samples)
        loss = loss + nll_loss_coef * nll
        metrics["nll_loss"] = nll.detach()
    return loss, finish_metrics(metrics, sync_metrics)
