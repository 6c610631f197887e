"""KTO: Kahneman-Tversky Optimization (a prospect-theory loss on unpaired answers).

On unpaired data (each answer labelled desirable or undesirable), with the policy/reference
log-ratio h = log pi(y|x) - log pi_ref(y|x) of each answer (summed over its tokens), beta =
`--beta` (OpenRLHF default 0.01) and the reference point

    z = max(0, mean over mismatched pairs (x_i, y_j) of [log pi(y_j|x_i) - log pi_ref(y_j|x_i)])

(a batch estimate of KL(pi || pi_ref), detached; as OpenRLHF <= 0.9.5 and TRL), the loss of
an answer is

    desirable:    w_d * (1 - sigmoid(beta * (h - z)))        w_d = `--desirable_loss_weight`
    undesirable:  w_u * (1 - sigmoid(beta * (z - h)))        w_u = `--undesirable_loss_weight`

summed and divided by the global answer count. Mismatched pairs pair each prompt with the
answer of another row (`mismatched_indices`: row i takes the answer of row i - 1). For a
reference point that does not depend on micro-batching, compute z once per step over all
ranks (`kto_reference_point` on the gathered sums) and pass it as `kl_reference`.
Metrics: `chosen_reward` / `rejected_reward` (local means of beta * h), `kl` (= z).
"""

from __future__ import annotations

import torch

from rlhfkit.losses.reduce import Count, finish_metrics, sample_sum_over

Tensor = torch.Tensor


def mismatched_indices(batch_size: int) -> Tensor:
    """Row i is paired with the answer of row (i - 1) mod B (needs B > 1)."""
    if batch_size < 2:
        raise ValueError("KTO's KL reference point needs at least 2 rows per batch to mismatch answers")
    return torch.roll(torch.arange(batch_size), 1)


def kto_reference_point(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """z = clamp(mean(log pi - log pi_ref) over mismatched pairs, min 0), detached scalar."""
    return (kl_logps.float() - ref_kl_logps.float()).mean().clamp(min=0.0).detach()


def kto_loss(logps: Tensor, ref_logps: Tensor, desirable: Tensor, *, beta: float = 0.01,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             kl_reference: Tensor | float | None = None, kl_logps: Tensor | None = None,
             ref_kl_logps: Tensor | None = None, num_samples: Count = None,
             sync_metrics: bool = True) -> tuple[Tensor, dict[str, float]]:
    """KTO loss of one micro-batch.

    Args:
        logps, ref_logps: `[B]` summed answer log-probs under policy and reference.
        desirable: `[B]` bool, True for desirable (label 1) answers.
        beta, desirable_weight, undesirable_weight: `--beta`, `--desirable_loss_weight`,
            `--undesirable_loss_weight`.
        kl_reference: the reference point z; if None it is estimated from this batch's
            mismatched pairs `kl_logps` / `ref_kl_logps` (`[B']` summed log-probs).
        num_samples: global answer count of the optimizer step.
    """
    if beta <= 0:
        raise ValueError(f"--beta must be > 0, got {beta}")
    if kl_reference is None:
        if kl_logps is None or ref_kl_logps is None:
            raise ValueError("kto_loss needs kl_reference or the mismatched-pair log-probs kl_logps/ref_kl_logps")
        kl_reference = kto_reference_point(kl_logps, ref_kl_logps)
    z = torch.as_tensor(kl_reference, dtype=torch.float32, device=logps.device).detach()
    h = logps.float() - ref_logps.float()
    good = desirable.to(device=logps.device).bool()
    good_loss = desirable_weight * (1.0 - torch.sigmoid(beta * (h - z)))
    bad_loss = undesirable_weight * (1.0 - torch.sigmoid(beta * (z - h)))
    loss = sample_sum_over(torch.where(good, good_loss, bad_loss), num_samples)
    rewards = beta * h.detach()
    metrics: dict[str, Tensor | float] = {"kto_loss": loss.detach(), "kl": z}
    if good.any():
        metrics["chosen_reward"] = rewards[good].mean()
    if (~good).any():
        metrics["rejected_reward"] = rewards[~good].mean()
    return loss, finish_metrics(metrics, sync_metrics)
