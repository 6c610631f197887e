"""SFT as an offline task: token NLL on response tokens, normalised by the global token count.

Items come from `rlhfkit.data.sft` (`input_ids`, `loss_mask`); batches are padded or, with
`--packing_samples`, packed into one row whose positions restart per sample. A VLM's items carry
pictures (`vision`, a `rlhfkit.models.vlm.VisionContext`): they are processed when a batch is
collated and go through the model with their rows (padded batches only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.data.collate import PackedBatch, PaddedBatch, pack_batch, pad_batch
from rlhfkit.losses.sft import sft_loss
from rlhfkit.losses.reduce import MicroMetrics
from rlhfkit.models.forward import token_logprobs
from rlhfkit.models.vlm import VisionContext, picture_logprob_kwargs


Batch = PaddedBatch | PackedBatch


@dataclass
class SFTTask:
    pad_token_id: int
    packing: bool = False
    device: torch.device | str = "cpu"
    dist: DistInfo = field(default_factory=DistInfo)  # whose dp group reduces the metrics
    vision: VisionContext | None = None  # a VLM's picture processing, None for text
    # its loss is a sum over tokens: the loop sums its training metrics over the loss group (the dp
    # group; docs/parallelism.md)
    TOKEN_ADDITIVE = True

    def collate(self, items: Sequence[Any]) -> Batch:
        pictures = self.vision.inputs_of if self.vision is not None else None
        batch = pack_batch(items) if self.packing else pad_batch(items, self.pad_token_id, pictures=pictures)
        return batch.to(self.device)

    def count(self, batch: Batch) -> float:
        return float(batch.num_loss_tokens)

    def _logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        mask, positions = batch.masks()
        vlm = picture_logprob_kwargs(model, batch)  # a VLM's rows with pictures: their positions and pictures
        return token_logprobs(model, batch.input_ids, attention_mask=mask, position_ids=vlm.get("position_ids", positions),
                              model_kwargs=vlm.get("model_kwargs"))

    def loss(self, model: torch.nn.Module, batch: Batch, global_count: float
             ) -> tuple[torch.Tensor, MicroMetrics]:
        lp = self._logprobs(model, batch)
        loss, _ = sft_loss(lp, batch.loss_mask, global_count, sync_metrics=False)
        # additive: summed over micro-batches and ranks it is the step's token-mean NLL; a device tensor
        # (the loop reads it after the optimizer step's sync)
        return loss, {"loss": loss.detach()}

    def eval_metrics(self, model: torch.nn.Module, batches: list[Batch]) -> dict[str, float]:
        nll = torch.zeros((), dtype=torch.float64)
        cnt = torch.zeros((), dtype=torch.float64)
        for b in batches:
            lp = self._logprobs(model, b)
            mask = b.loss_mask.to(lp.dtype)
            nll += -(lp * mask).sum().double().cpu()
            cnt += mask.sum().double().cpu()
        tot = self.dist.all_reduce_dp(torch.stack([nll, cnt]))
        return {"eval/loss": float(tot[0] / tot[1].clamp(min=1))}
