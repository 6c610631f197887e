"""Reward-model training as an offline task: pairwise Bradley-Terry loss on last-token scores.

    PreferenceItem x B --collate_pairs--> PairBatch: 2B sequences (chosen 0..B-1, rejected B..2B-1)
        padded [2B, L] (+ attention_mask)  or  packed [1, T] (positions restart per sequence)
    value model --> values [2B, L] / [1, T] --last_token_rewards--> r [2B] --> r_c = r[:B], r_r = r[B:]
    loss = sum_b l(r_c - r_r - m_b) / global pair count        (rlhfkit.losses.reward_model)

Chosen and rejected sequences run in one forward pass, as in OpenRLHF. The score of a sequence
is the value at its last real token (right or left padding; the end of each packed sequence),
which is what `AutoModelForSequenceClassification` reads from a saved model.

Metrics follow the loop's additive convention (docs in rlhfkit.trainers.offline): a micro-batch
reports sum-over-pairs / global pair count, so the loop's sum over micro-batches and ranks is
the step mean. `reward_statistics` gives the mean and (unbiased) std of the scores of every
chosen and rejected sequence of a set, which train_rm stores in the saved config for
`--normalize_reward` (as OpenRLHF does with its eval set).

The pair helpers (`PairBatch`, `collate_pairs`, `additive`) are shared with DPO (dpo_task.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from rlhfkit.config.declare import default_of
from rlhfkit.config.offline_flags import RewardLossFlags
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.data.collate import PackedBatch, PaddedBatch, pack_batch, pad_batch
from rlhfkit.data.items import PreferenceItem
from rlhfkit.data.preference import preference_rows
from rlhfkit.losses.reward_model import RM_LOSSES, pairwise_rm_loss
from rlhfkit.losses.reduce import MicroMetrics
from rlhfkit.models.forward import hf_detects_packing
from rlhfkit.models.value import reward_at_last_token

Tensor = torch.Tensor
Seqs = PaddedBatch | PackedBatch


@dataclass
class PairBatch:
    """B preference pairs as 2B sequences: `seqs` rows 0..B-1 chosen, B..2B-1 rejected; `margin [B]`."""

    seqs: Seqs
    margin: Tensor

    @property
    def num_pairs(self) -> int:
        return int(self.margin.shape[0])

    def to(self, device: torch.device | str) -> "PairBatch":
        return PairBatch(self.seqs.to(device), self.margin.to(device))


def collate_seqs(items: Sequence[Any], pad_token_id: int, packing: bool, pictures: Any = None) -> Seqs:
    """Items with `input_ids`/`loss_mask` -> right-padded `[N, L]` or one packed row `[1, T]`
    (`pictures`: a VLM's refs -> `ImageInputs`, padded rows only)."""
    return pack_batch(items) if packing else pad_batch(items, pad_token_id, pictures=pictures)


def collate_pairs(items: Sequence[PreferenceItem], pad_token_id: int, packing: bool,
                  pictures: Any = None) -> PairBatch:
    """Preference pairs -> one `PairBatch` (chosen first, then rejected; `preference_rows`)."""
    if not items:
        raise ValueError("collate_pairs: empty micro-batch")
    margin = torch.tensor([float(it.margin) for it in items], dtype=torch.float32)
    return PairBatch(collate_seqs(preference_rows(items), pad_token_id, packing, pictures), margin)


def additive(local_mean: float | Tensor, local_count: float, global_count: float) -> float | Tensor:
    """A local mean as the loop's additive contribution: mean * local count / global count (a device
    tensor stays one, in double: no sync)."""
    if isinstance(local_mean, Tensor):
        return local_mean.detach().double() * float(local_count) / max(float(global_count), 1.0)
    return float(local_mean) * float(local_count) / max(float(global_count), 1.0)


def sequence_ends(seq_lens: Sequence[int], device: torch.device | str) -> Tensor:
    """`[N]` index of the last token of each packed sequence in the packed row."""
    return torch.tensor(seq_lens, device=device).cumsum(0) - 1


def last_token_rewards(model: torch.nn.Module, seqs: Seqs) -> Tensor:
    """`[N]` fp32 score of each sequence: the value-head output at its last real token."""
    if isinstance(seqs, PackedBatch):
        values = model(input_ids=seqs.input_ids, position_ids=seqs.position_ids)  # [1, T]
        return values[0].float().index_select(0, sequence_ends(seqs.seq_lens, values.device))
    values = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask)
    return reward_at_last_token(values.float(), seqs.attention_mask)


@dataclass
class RMTask:
    """Pairwise reward-model training (`--loss`, `--margin_loss`, `--packing_samples`).

    Scores are always fp32 (the value model casts its head output), so the loss is computed in
    fp32 whether or not `--compute_fp32_loss` is given.
    """

    pad_token_id: int
    loss_type: str = "sigmoid"
    margin_loss: bool = default_of(RewardLossFlags, "margin_loss")
    packing: bool = False
    device: torch.device | str = "cpu"
    dist: DistInfo = field(default_factory=DistInfo)  # whose dp group reduces the metrics
    TOKEN_ADDITIVE = False  # a loss over pairs / samples: the loop sums its metrics over the dp group

    def __post_init__(self) -> None:
        if self.loss_type not in RM_LOSSES:
            raise ValueError(f"--loss must be one of {RM_LOSSES}, got {self.loss_type!r}")
        if self.margin_loss and self.loss_type != "sigmoid":
            raise ValueError("--margin_loss needs --loss sigmoid (the logexp loss takes no margin)")
        if self.packing and not hf_detects_packing():
            raise ValueError("--packing_samples for reward models needs transformers >= 4.56 (packed samples are "
                             "kept apart through position_ids)")

    def collate(self, items: Sequence[PreferenceItem]) -> PairBatch:
        return collate_pairs(items, self.pad_token_id, self.packing).to(self.device)

    def count(self, batch: PairBatch) -> float:
        return float(batch.num_pairs)

    def rewards(self, model: torch.nn.Module, batch: PairBatch) -> tuple[Tensor, Tensor]:
        """(chosen `[B]`, rejected `[B]`) scores from one forward over the 2B sequences."""
        r = last_token_rewards(model, batch.seqs)
        b = batch.num_pairs
        return r[:b], r[b:]

    def _pair_loss(self, rc: Tensor, rr: Tensor, batch: PairBatch, count: float) -> Tensor:
        margin = batch.margin if self.margin_loss else None
        loss, _ = pairwise_rm_loss(rc, rr, margin=margin, loss_type=self.loss_type, num_samples=count,
                                   sync_metrics=False)
        return loss

    def loss(self, model: torch.nn.Module, batch: PairBatch, global_count: float
             ) -> tuple[Tensor, MicroMetrics]:
        rc, rr = self.rewards(model, batch)
        loss = self._pair_loss(rc, rr, batch, global_count)
        rc, rr = rc.detach(), rr.detach()
        g = max(global_count, 1.0)
        # device tensors, read by the loop after the optimizer step (in double, as python floats would be)
        sums = torch.stack([(rc > rr).float().sum(), rc.sum(), rr.sum(), (rc - rr).sum()]).double().unbind()
        metrics = {"loss": loss.detach().double()}
        metrics.update({k: v / g for k, v in zip(("acc", "chosen_reward", "rejected_reward", "margin"), sums)})
        return loss, metrics

    @torch.no_grad()
    def eval_metrics(self, model: torch.nn.Module, batches: list[PairBatch]) -> dict[str, float]:
        """eval/loss, eval/acc, eval/chosen_reward, eval/rejected_reward, eval/margin (means over pairs)."""
        sums = torch.zeros(6, dtype=torch.float64)
        for b in batches:
            rc, rr = self.rewards(model, b)
            loss_sum = self._pair_loss(rc, rr, b, 1.0)  # count 1: the sum over pairs
            sums += torch.stack([loss_sum.double().cpu(), (rc > rr).double().sum().cpu(), rc.double().sum().cpu(),
                                 rr.double().sum().cpu(), (rc - rr).double().sum().cpu(),
                                 torch.tensor(float(b.num_pairs), dtype=torch.float64)])
        sums = self.dist.all_reduce_dp(sums)
        n = float(sums[5].clamp(min=1.0))
        names = ("eval/loss", "eval/acc", "eval/chosen_reward", "eval/rejected_reward", "eval/margin")
        return {k: float(v) / n for k, v in zip(names, sums[:5].tolist())}


@torch.no_grad()
def reward_statistics(model: torch.nn.Module, task: RMTask, items: Sequence[PreferenceItem],
                      micro_batch_size: int, dist: DistInfo) -> tuple[float, float, int]:
    """(mean, unbiased std, count) of the scores of all chosen and rejected sequences of `items`.

    Every rank runs the same number of forward passes (a sharded model gathers weights in each),
    padding its share with a repeat of its first item whose scores are discarded.
    """
    if not items:
        raise ValueError("reward statistics need at least one preference pair")
    was_training = model.training
    model.eval()
    share = list(range(dist.dp_rank, len(items), dist.dp_size))
    per_rank = math.ceil(len(items) / dist.dp_size)
    stats = torch.zeros(3, dtype=torch.float64)  # sum, sum of squares, count
    for j in range(0, per_rank, micro_batch_size):
        idx = share[j:j + micro_batch_size]
        real = len(idx)
        if real == 0:
            idx = [share[0] if share else 0]
        rc, rr = task.rewards(model, task.collate([items[i] for i in idx]))
        r = torch.cat([rc[:real], rr[:real]]).double().cpu()
        stats += torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(r.numel()), dtype=torch.float64)])
    s, sq, n = dist.all_reduce_dp(stats).tolist()
    if was_training:
        model.train()
    mean = s / n
    var = (sq - n * mean * mean) / max(n - 1.0, 1.0)
    return mean, math.sqrt(max(var, 0.0)), int(n)
