"""Knowledge distillation as an offline task: student NLL + forward KL to a frozen teacher.

    SFTItem x B --collate--> padded [B, L] or packed [1, T] (input_ids, loss_mask)
    student --forward_logits--> s [B, L, V]           teacher (no_grad) --> t [B, L, V]
    row t-1 of the logits predicts token t:  logits[:, :-1]  vs  labels = input_ids[:, 1:],
                                             mask = loss_mask[:, 1:]
    loss = (1 - kd_coef) NLL + kd_coef KL(teacher || student), token sums / global token count

Formulas in rlhfkit.losses.distill (token-level KD as OpenRLHF's train_kd). In a packed row the
logits at a sample's last token "predict" the next sample's first token, whose loss_mask is
always 0, so no pair crosses a sample boundary. `--teacher_offload` keeps the teacher in CPU
memory between its forwards (`FrozenModel`).

Additive metrics (token sums / global response-token count): `loss`, `kd_loss`, `nll_loss`.
Eval: `eval/loss`, `eval/kd_loss`, `eval/nll_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlhfkit.config.declare import default_of
from rlhfkit.config.offline_flags import KDFlags
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.data.items import SFTItem
from rlhfkit.losses.distill import distill_loss
from rlhfkit.losses.reduce import MicroMetrics
from rlhfkit.models.forward import forward_logits
from rlhfkit.trainers.dpo_task import FrozenModel
from rlhfkit.trainers.rm_task import Seqs, additive, collate_seqs

Tensor = torch.Tensor


def _logits(model: torch.nn.Module, seqs: Seqs) -> Tensor:
    mask, positions = seqs.masks()
    return forward_logits(model, seqs.input_ids, attention_mask=mask, position_ids=positions)


@dataclass
class KDTask:
    """Distil `teacher` into the trained model on response tokens (`--kd_coef`)."""

    pad_token_id: int
    teacher: FrozenModel
    kd_coef: float = default_of(KDFlags, "kd_coef")
    packing: bool = False
    device: torch.device | str = "cpu"
    dist: DistInfo = field(default_factory=DistInfo)  # whose dp group reduces the metrics
    # its loss is a sum over tokens: the loop sums its training metrics over the loss group (the dp
    # group; docs/parallelism.md)
    TOKEN_ADDITIVE = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.kd_coef <= 1.0:
            raise ValueError(f"--kd_coef must be in [0, 1], got {self.kd_coef}")

    def collate(self, items: Sequence[SFTItem]) -> Seqs:
        return collate_seqs(items, self.pad_token_id, self.packing).to(self.device)

    def count(self, batch: Seqs) -> float:
        return float(batch.num_loss_tokens)

    def _loss(self, model: torch.nn.Module, batch: Seqs, count: float, sync: bool = True
              ) -> tuple[Tensor, dict[str, float]]:
        with self.teacher.use() as teacher:
            t_logits = _logits(teacher, batch)
        s_logits = _logits(model, batch)
        if t_logits.shape[-1] != s_logits.shape[-1]:
            raise ValueError(f"--teacher_model has a vocabulary of {t_logits.shape[-1]} logits but the student "
                             f"(--pretrain) has {s_logits.shape[-1]}; distillation needs the same vocabulary")
        return distill_loss(s_logits[:, :-1], t_logits[:, :-1], batch.input_ids[:, 1:], batch.loss_mask[:, 1:],
                            kd_coef=self.kd_coef, num_tokens=count, sync_metrics=sync)

    def loss(self, model: torch.nn.Module, batch: Seqs, global_count: float
             ) -> tuple[Tensor, MicroMetrics]:
        loss, m = self._loss(model, batch, global_count, sync=False)
        n = batch.num_loss_tokens  # device tensors, read by the loop after the optimizer step
        return loss, {"loss": loss.detach().double(), "kd_loss": additive(m["kd_loss"], n, global_count),
                      "nll_loss": additive(m["nll_loss"], n, global_count)}

    @torch.no_grad()
    def eval_metrics(self, model: torch.nn.Module, batches: list[Seqs]) -> dict[str, float]:
        sums = torch.zeros(4, dtype=torch.float64)  # loss sum, kd sum, nll sum, tokens
        for b in batches:
            loss_sum, m = self._loss(model, b, 1.0)
            n = b.num_loss_tokens
            sums += torch.tensor([float(loss_sum), m["kd_loss"] * n, m["nll_loss"] * n, n], dtype=torch.float64)
        s = self.dist.all_reduce_dp(sums).tolist()
        n = max(s[3], 1.0)
        return {"eval/loss": s[0] / n, "eval/kd_loss": s[1] / n, "eval/nll_loss": s[2] / n}
