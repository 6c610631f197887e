"""Process reward model loss (Math-Shepherd style: one label per reasoning step).

Each reasoning step ends with a placeholder token (`--placeholder_token`); the model is
trained so that its logits *at the placeholder position* predict the step's label among the
reward tokens (`--reward_tokens`, e.g. "+" "-"):

    hard labels (label = a reward token id, -100 to skip):
        L = CE(logits[p, reward_tokens], index of the label)          (full vocab if no reward tokens)
    soft labels (label = float probability q of the first reward token, two reward tokens):
        L = -(q log p_+ + (1 - q) log p_-),  p = softmax(logits[p, reward_tokens])

summed over placeholder positions and divided by the global count of such positions.
Metrics: `prm_accuracy` (argmax equals the label; for soft labels q > 0.5), `prm_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from rlhfkit.losses.reduce import Count, finish_metrics, sample_sum_over

Tensor = torch.Tensor
IGNORE_INDEX = -100


def _hard_targets(labels: Tensor, reward_token_ids: Sequence[int] | None) -> Tensor:
    """Token-id labels -> class indices among the reward tokens (IGNORE_INDEX kept)."""
    if reward_token_ids is None:
        return labels
    ids = torch.as_tensor(list(reward_token_ids), device=labels.device)
    match = labels[:, None] == ids[None, :]
    bad = ~(match.any(dim=1) | (labels == IGNORE_INDEX))
    if bad.any():
        raise ValueError(f"PRM label token {int(labels[bad][0])} at a placeholder is not one of "
                         f"--reward_tokens ids {list(reward_token_ids)}")
    return torch.where(labels == IGNORE_INDEX, labels, match.long().argmax(dim=1))


def prm_loss(logits: Tensor, input_ids: Tensor, labels: Tensor, *, placeholder_token_id: int,
             reward_token_ids: Sequence[int] | None = None,
             num_tokens: Count = None, sync_metrics: bool = True) -> tuple[Tensor, dict[str, float]]:
    """PRM cross-entropy of one micro-batch.

    Args:
        logits: `[B, L, V]` model logits (position t = the output at token t, not shifted).
        input_ids: `[B, L]` tokens; positions equal to `placeholder_token_id` are scored.
        labels: `[B, L]` long reward-token ids (hard) or float probabilities (soft).
        reward_token_ids: token ids of `--reward_tokens` (two for soft labels).
        num_tokens: global count of scored placeholder positions of the step.
    """
    where = input_ids == placeholder_token_id
    lg = logits[where].float()
    lb = labels[where]
    if reward_token_ids is not None:
        lg = lg[:, list(reward_token_ids)]
    if lb.is_floating_point():
        if reward_token_ids is None or len(reward_token_ids) != 2:
            raise ValueError("soft (float) PRM labels need exactly two --reward_tokens")
        keep = lb != IGNORE_INDEX
        q = lb.float()
        logp = F.log_softmax(lg, dim=-1)
        per = -(q * logp[:, 0] + (1 - q) * logp[:, 1]) * keep.float()
        correct = ((logp[:, 0] > logp[:, 1]) == (q > 0.5)).float()
    else:
        target = _hard_targets(lb, reward_token_ids)
        keep = target != IGNORE_INDEX
        per = F.cross_entropy(lg, target, ignore_index=IGNORE_INDEX, reduction="none")
        correct = (lg.argmax(dim=-1) == target).float()
    count = keep.float().sum()
    loss = sample_sum_over(per, num_tokens if num_tokens is not None else count)
    acc = (correct * keep.float()).sum() / count.clamp(min=1.0)
    return loss, finish_metrics({"prm_loss": loss.detach(), "prm_accuracy": acc}, sync_metrics)
