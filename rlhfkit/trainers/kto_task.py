"""KTO as an offline task: unpaired desirable/undesirable answers against a frozen reference.

    UnpairedItem x B --collate--> KTOBatch
        seqs     [B]  (prompt_i, answer_i)               policy with grad, reference no_grad
        kl_seqs  [B]  (prompt_i, answer_{i+1 mod B})      policy and reference, no_grad
        desirable [B] bool (--label_key)
    h_i = sum over answer tokens of log pi - log pi_ref            (sequence_logps)
    z   = max(0, mean over the mismatched pairs of all ranks of (log pi - log pi_ref))
    loss = kto_loss(h, desirable, z) summed / global answer count  (rlhfkit.losses.kto)

KTO (Kahneman-Tversky Optimization); the formulas are in rlhfkit.losses.kto.
The reference point z is estimated per micro-batch from its mismatched pairs (`kto_mismatched`)
and averaged over ranks, as OpenRLHF's KTO trainer does, so each rank's micro-batch needs at
least two answers (`--micro_train_batch_size >= 2`, checked by train_kto; a lone answer, e.g. the
last eval batch, is paired with itself). z is a detached batch estimate of
KL(pi || pi_ref); it is the one part of the loss that depends on the micro-batch size.
In evaluation z is estimated per eval batch on each rank (no collective per batch).

Additive metrics (sums over answers / global answer count): `loss`, `kl` (z weighted by
micro-batch size), `signed_reward` (mean of +beta h for desirable and -beta h for undesirable
answers: it grows as training separates them). Eval: `eval/loss`, `eval/kl`,
`eval/chosen_reward` / `eval/rejected_reward` (mean beta h over desirable / undesirable answers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlhfkit.config.declare import default_of
from rlhfkit.config.offline_flags import KTOFlags
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.data.items import UnpairedItem
from rlhfkit.data.preference import kto_mismatched
from rlhfkit.losses.kto import kto_loss
from rlhfkit.losses.reduce import MicroMetrics
from rlhfkit.trainers.dpo_task import FrozenModel, sequence_logps
from rlhfkit.trainers.rm_task import Seqs, collate_seqs

Tensor = torch.Tensor


@dataclass
class KTOBatch:
    """`seqs` the B (prompt, answer) sequences, `kl_seqs` the B mismatched ones, `desirable [B]` bool."""

    seqs: Seqs
    kl_seqs: Seqs
    desirable: Tensor

    @property
    def size(self) -> int:
        return int(self.desirable.shape[0])

    def to(self, device: torch.device | str) -> "KTOBatch":
        return KTOBatch(self.seqs.to(device), self.kl_seqs.to(device), self.desirable.to(device))


KTO_BETA = 0.01  # --beta of train_kto (its parser's default)


@dataclass
class KTOTask:
    """KTO against `ref` (`--beta`, `--desirable_loss_weight`, `--undesirable_loss_weight`)."""

    pad_token_id: int
    ref: FrozenModel
    max_len: int
    beta: float = KTO_BETA
    desirable_weight: float = default_of(KTOFlags, "desirable_loss_weight")
    undesirable_weight: float = default_of(KTOFlags, "undesirable_loss_weight")
    packing: bool = False
    device: torch.device | str = "cpu"
    dist: DistInfo = field(default_factory=DistInfo)  # whose dp group reduces the metrics
    TOKEN_ADDITIVE = False  # a loss over pairs / samples: the loop sums its metrics over the dp group

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError("--desirable_loss_weight and --undesirable_loss_weight must be >= 0")

    def collate(self, items: Sequence[UnpairedItem]) -> KTOBatch:
        if not items:
            raise ValueError("KTOTask.collate: empty micro-batch")
        batch = KTOBatch(collate_seqs(items, self.pad_token_id, self.packing),
                         collate_seqs(kto_mismatched(items, self.max_len), self.pad_token_id, self.packing),
                         torch.tensor([bool(it.label) for it in items], dtype=torch.bool))
        return batch.to(self.device)

    def count(self, batch: KTOBatch) -> float:
        return float(batch.size)

    def _kl_sums(self, model: torch.nn.Module, batch: KTOBatch, ref_kl: Tensor) -> Tensor:
        """[sum over mismatched pairs of (log pi - log pi_ref), pair count], float64 on CPU."""
        with torch.no_grad():
            kl_lp, _ = sequence_logps(model, batch.kl_seqs)
        diff = (kl_lp.float() - ref_kl.float()).double().cpu()
        return torch.stack([diff.sum(), torch.tensor(float(diff.numel()), dtype=torch.float64)])

    def _terms(self, model: torch.nn.Module, batch: KTOBatch, count: float, reduce_kl: bool
               ) -> tuple[Tensor, Tensor, Tensor]:
        """(loss over `count` answers, z, beta * h `[B]`)."""
        with self.ref.use() as ref_model:
            ref_lp, _ = sequence_logps(ref_model, batch.seqs)
            ref_kl, _ = sequence_logps(ref_model, batch.kl_seqs)
        kl = self._kl_sums(model, batch, ref_kl)
        if reduce_kl:
            kl = self.dist.all_reduce_dp(kl)
        z = torch.tensor(max(float(kl[0] / kl[1].clamp(min=1.0)), 0.0), device=ref_lp.device)
        lp, _ = sequence_logps(model, batch.seqs)
        loss, _ = kto_loss(lp, ref_lp, batch.desirable, beta=self.beta, desirable_weight=self.desirable_weight,
                           undesirable_weight=self.undesirable_weight, kl_reference=z, num_samples=count,
                           sync_metrics=False)
        return loss, z, self.beta * (lp.detach().float() - ref_lp.float())

    def loss(self, model: torch.nn.Module, batch: KTOBatch, global_count: float
             ) -> tuple[Tensor, MicroMetrics]:
        loss, z, rewards = self._terms(model, batch, global_count, reduce_kl=True)
        g = max(global_count, 1.0)
        sign = batch.desirable.float() * 2.0 - 1.0
        # device tensors, read by the loop after the optimizer step (in double, as python floats would be)
        return loss, {"loss": loss.detach().double(), "kl": z.double() * batch.size / g,
                      "signed_reward": (sign * rewards).sum().double() / g}

    @torch.no_grad()
    def eval_metrics(self, model: torch.nn.Module, batches: list[KTOBatch]) -> dict[str, float]:
        # loss sum, z * size, desirable reward sum, desirable count, undesirable reward sum, undesirable count, n
        sums = torch.zeros(7, dtype=torch.float64)
        for b in batches:
            loss_sum, z, r = self._terms(model, b, 1.0, reduce_kl=False)
            good = b.desirable
            sums += torch.tensor([float(loss_sum), float(z) * b.size, float(r[good].sum()), float(good.sum()),
                                  float(r[~good].sum()), float((~good).sum()), float(b.size)], dtype=torch.float64)
        s = self.dist.all_reduce_dp(sums).tolist()
        n = max(s[6], 1.0)
        out = {"eval/loss": s[0] / n, "eval/kl": s[1] / n}
        if s[3] > 0:
            out["eval/chosen_reward"] = s[2] / s[3]
        if s[5] > 0:
            out["eval/rejected_reward"] = s[4] / s[5]
        return out
