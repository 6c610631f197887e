"""Pairwise reward-model losses (Bradley-Terry), on scalar rewards of chosen/rejected answers.

    sigmoid (default):  -log sigmoid(r_c - r_r - m)
        m = the pair's margin (`--margin_loss` with a `margin` column; Llama 2 style), else 0
    logexp:             log(1 + exp(r_r - r_c))
        computed as softplus(r_r - r_c); equal to the sigmoid loss without margin. Like
        OpenRLHF's LogExpLoss it takes no margin.

Summed over pairs and divided by the global pair count of the step. Metrics (local means):
`accuracy` (r_c > r_r), `chosen_reward`, `rejected_reward`, `reward_margin`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhfkit.losses.reduce import Count, finish_metrics, sample_sum_over

Tensor = torch.Tensor
RM_LOSSES = ("sigmoid", "logexp")


def pairwise_rm_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, *, margin: Tensor | None = None,
                     loss_type: str = "sigmoid", num_samples: Count = None, sync_metrics: bool = True
                     ) -> tuple[Tensor, dict[str, float]]:
    """Bradley-Terry loss of one micro-batch of `[B]` chosen / rejected rewards (`--loss`)."""
    if loss_type not in RM_LOSSES:
        raise ValueError(f"reward-model --loss {loss_type!r} is not one of {RM_LOSSES}")
    rc, rr = chosen_rewards.float(), rejected_rewards.float()
    if loss_type == "sigmoid":
        diff = rc - rr - (margin.float() if margin is not None else 0.0)
        per_pair = -F.logsigmoid(diff)
    else:
        if margin is not None:
            raise ValueError("--margin_loss needs the sigmoid reward-model loss (--loss sigmoid)")
        per_pair = F.softplus(rr - rc)
    loss = sample_sum_over(per_pair, num_samples)
    metrics = {
        "accuracy": (rc > rr).float().mean(),
        "chosen_reward": rc.detach().mean(),
        "rejected_reward": rr.detach().mean(),
        "reward_margin": (rc - rr).detach().mean(),
    }
    return loss, finish_metrics(metrics, sync_metrics)
