"""Process reward model (PRM) training as an offline task.

    PRMItem x B --collate--> PRMBatch: seqs (padded [B, L] or packed [1, T]) + labels (same shape)
    causal LM --forward_logits--> logits [B, L, V]
    loss = prm_loss(logits, input_ids, labels) over placeholder positions / global labelled count

Math-Shepherd style PRM, as OpenRLHF's train_prm: the
logits *at* each `--placeholder_token` position, restricted to `--reward_tokens`, are trained to
predict the step's label (hard: a reward token; soft: the probability of the first reward
token). See rlhfkit.losses.prm and rlhfkit.data.prm.

Additive metrics (sums over labelled positions / global labelled count): `loss`, `acc`.
Eval: `eval/loss`, `eval/acc`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.data.collate import pack_batch
from rlhfkit.data.items import PRMItem, SFTItem
from rlhfkit.data.prm import IGNORE_INDEX, collate_prm
from rlhfkit.losses.prm import prm_loss
from rlhfkit.losses.reduce import MicroMetrics
from rlhfkit.models.forward import forward_logits
from rlhfkit.trainers.rm_task import Seqs, additive

Tensor = torch.Tensor


@dataclass
class PRMBatch:
    """`seqs` (loss_mask = 1 at labelled placeholder positions) and `labels`, same shape as the ids."""

    seqs: Seqs
    labels: Tensor

    @property
    def num_labels(self) -> int:
        return int(self.seqs.loss_mask.sum())

    def to(self, device: torch.device | str) -> "PRMBatch":
        return PRMBatch(self.seqs.to(device), self.labels.to(device))


def collate_prm_batch(items: Sequence[PRMItem], pad_token_id: int, packing: bool) -> PRMBatch:
    """Padded (`collate_prm`) or packed: one row of all ids and one row of all labels."""
    if not packing:
        return PRMBatch(*collate_prm(items, pad_token_id))
    soft = any(it.soft for it in items)
    seqs = pack_batch([SFTItem(it.input_ids, [int(v != IGNORE_INDEX) for v in it.labels]) for it in items])
    flat = [v for it in items for v in it.labels]
    labels = torch.tensor(flat, dtype=torch.float32 if soft else torch.long).unsqueeze(0)
    return PRMBatch(seqs, labels)


@dataclass
class PRMTask:
    """PRM cross-entropy at `placeholder_token_id` positions over `reward_token_ids` (None: full vocab)."""

    pad_token_id: int
    placeholder_token_id: int
    reward_token_ids: list[int] | None = None
    packing: bool = False
    device: torch.device | str = "cpu"
    dist: DistInfo = field(default_factory=DistInfo)  # whose dp group reduces the metrics
    # its loss is a sum over tokens: the loop sums its training metrics over the loss group (the dp
    # group; docs/parallelism.md)
    TOKEN_ADDITIVE = True

    def collate(self, items: Sequence[PRMItem]) -> PRMBatch:
        return collate_prm_batch(items, self.pad_token_id, self.packing).to(self.device)

    def count(self, batch: PRMBatch) -> float:
        return float(batch.num_labels)

    def _loss(self, model: torch.nn.Module, batch: PRMBatch, count: float, sync: bool = True
              ) -> tuple[Tensor, dict[str, float]]:
        s = batch.seqs
        mask, positions = s.masks()
        logits = forward_logits(model, s.input_ids, attention_mask=mask, position_ids=positions)
        return prm_loss(logits, s.input_ids, batch.labels, placeholder_token_id=self.placeholder_token_id,
                        reward_token_ids=self.reward_token_ids, num_tokens=count, sync_metrics=sync)

    def loss(self, model: torch.nn.Module, batch: PRMBatch, global_count: float
             ) -> tuple[Tensor, MicroMetrics]:
        loss, m = self._loss(model, batch, global_count, sync=False)  # device tensors, read after the step
        return loss, {"loss": loss.detach().double(),
                      "acc": additive(m["prm_accuracy"], batch.num_labels, global_count)}

    @torch.no_grad()
    def eval_metrics(self, model: torch.nn.Module, batches: list[PRMBatch]) -> dict[str, float]:
        sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, labelled positions
        for b in batches:
            loss_sum, m = self._loss(model, b, 1.0)
            sums += torch.tensor([float(loss_sum), m["prm_accuracy"] * b.num_labels, b.num_labels],
                                 dtype=torch.float64)
        s = self.dist.all_reduce_dp(sums).tolist()
        n = max(s[2], 1.0)
        return {"eval/loss": s[0] / n, "eval/acc": s[1] / n}
