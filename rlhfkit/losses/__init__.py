"""Losses. Every loss returns `(loss, metrics: dict[str, float])` and divides by a global
token / sequence / sample count passed in by the caller (losses/reduce.py), so results do
not depend on micro-batching or the number of ranks. Pure torch (CPU-testable)."""

from rlhfkit.losses.correction import IS_CORRECTIONS, is_correction_weights
from rlhfkit.losses.distill import distill_loss, forward_kl
from rlhfkit.losses.kl import kl_loss
from rlhfkit.losses.kto import kto_loss, kto_reference_point, mismatched_indices
from rlhfkit.losses.policy import (
    POLICY_LOSSES,
    PolicyLossConfig,
    clipped_surrogate,
    policy_loss,
    policy_loss_on_batch,
)
from rlhfkit.losses.preference import dpo_loss, preference_pair_losses
from rlhfkit.losses.prm import prm_loss
from rlhfkit.losses.reduce import aggregate, sample_sum_over, seq_mean_over, to_floats, token_sum_over
from rlhfkit.losses.reward_model import pairwise_rm_loss
from rlhfkit.losses.sft import sft_loss
from rlhfkit.losses.value import value_loss

__all__ = [
    "IS_CORRECTIONS", "is_correction_weights", "distill_loss", "forward_kl", "kl_loss", "kto_loss",
    "kto_reference_point", "mismatched_indices", "POLICY_LOSSES", "PolicyLossConfig", "clipped_surrogate",
    "policy_loss", "policy_loss_on_batch", "dpo_loss", "preference_pair_losses", "prm_loss", "aggregate",
    "sample_sum_over", "seq_mean_over", "to_floats", "token_sum_over", "pairwise_rm_loss", "sft_loss",
    "value_loss",
]
