"""DPO / IPO / cDPO as an offline task, with a frozen reference model.

    PreferenceItem x B --collate_pairs--> 2B sequences (chosen, then rejected), padded or packed
    policy    --token_logprobs--> lp [2B, L] --masked sums over response tokens--> logp [2B]  (grad)
    reference --token_logprobs--> same, under no_grad                             --> ref_logp [2B]
    loss = dpo_loss(logp[:B], logp[B:], ref_logp[:B], ref_logp[B:]) / global pair count

Formulas are in rlhfkit.losses.preference: DPO, cDPO (`--label_smoothing`), IPO (`--ipo`),
and the optional NLL term on the chosen
response (`--nll_loss_coef`, per-token mean NLL of each chosen answer).

Reference log-probs are computed per micro-batch under `torch.no_grad` from a frozen copy (a
`FrozenModel`), as OpenRLHF does, rather than precomputed once per dataset: nothing is cached,
packing and any data order work unchanged, and a typical single epoch would use each
reference value once anyway. `--ref_offload` keeps the reference weights in CPU memory and moves
them to the device only for its forward pass (slower; saves one model of accelerator memory).

Metrics are additive (sums over pairs / global pair count): `loss`, `preference_loss`,
`chosen_reward` = beta (log pi(y_c) - log pi_ref(y_c)), `rejected_reward`, `acc` (chosen
reward > rejected reward), `margin` (chosen - rejected reward), and `nll_loss` when used.

`FrozenModel`, `sequence_logps` and `masked_sums` are shared with KTO and distillation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from rlhfkit.config.configs import BetaFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.offline_flags import DPOFlags
from rlhfkit.backend.base import TrainBackend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.data.collate import PackedBatch
from rlhfkit.data.items import PreferenceItem
from rlhfkit.losses.preference import dpo_loss
from rlhfkit.losses.reduce import MicroMetrics
from rlhfkit.models.forward import token_logprobs
from rlhfkit.models.vlm import VisionContext, picture_logprob_kwargs
from rlhfkit.trainers.rm_task import PairBatch, Seqs, collate_pairs

Tensor = torch.Tensor


class FrozenModel:
    """A frozen model (reference, teacher) held by an inference-only backend (`optim_cfg=None`).

    `with frozen.use() as model:` gives the module for a no-grad forward. With `offload=True`
    the weights stay in CPU memory between forwards (`backend.offload_states` /
    `reload_states`; on a CPU device the round trip runs and saves nothing): read the module only
    inside `use()`, which may nest (the outermost one reloads and offloads).
    """

    def __init__(self, backend: TrainBackend, offload: bool = False) -> None:
        self.backend = backend
        self.offload = offload
        self._users = 0  # nested use(): the outermost one reloads and offloads
        backend.eval()
        for p in backend.model.parameters():
            p.requires_grad_(False)
        if offload:
            backend.offload_states()

    @contextlib.contextmanager
    def use(self) -> Iterator[torch.nn.Module]:
        if self.offload and self._users == 0:
            self.backend.reload_states()
        self._users += 1
        try:
            with torch.no_grad():
                yield self.backend.model
        finally:
            self._users -= 1
            if self.offload and self._users == 0:
                self.backend.offload_states()


def masked_sums(values: Tensor, seqs: Seqs) -> tuple[Tensor, Tensor]:
    """(`[N]` sums of `values * loss_mask` per sequence, `[N]` loss-token counts); padded or packed."""
    mask = seqs.loss_mask.to(values.dtype)
    if isinstance(seqs, PackedBatch):
        lens = torch.tensor(seqs.seq_lens, device=values.device)
        seg = torch.repeat_interleave(torch.arange(len(seqs.seq_lens), device=values.device), lens)
        zeros = values.new_zeros(len(seqs.seq_lens))
        return zeros.index_add(0, seg, (values * mask)[0]), zeros.index_add(0, seg, mask[0])
    return (values * mask).sum(-1), mask.sum(-1)


def sequence_logps(model: torch.nn.Module, seqs: Seqs) -> tuple[Tensor, Tensor]:
    """(`[N]` summed response log-probs, `[N]` response token counts) of padded or packed sequences."""
    mask, positions = seqs.masks()
    vlm = picture_logprob_kwargs(model, seqs)  # a VLM's rows with pictures: their positions and pictures
    lp = token_logprobs(model, seqs.input_ids, attention_mask=mask, position_ids=vlm.get("position_ids", positions),
                        model_kwargs=vlm.get("model_kwargs"))
    return masked_sums(lp, seqs)


def check_dpo_settings(beta: float, label_smoothing: float, ipo: bool, nll_loss_coef: float) -> None:
    """Raise a ValueError naming the flag of a bad DPO setting."""
    if beta <= 0:
        raise ValueError(f"--beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"--label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if ipo and label_smoothing > 0:
        raise ValueError("--label_smoothing (cDPO) cannot be combined with --ipo")
    if nll_loss_coef < 0:
        raise ValueError(f"--nll_loss_coef must be >= 0, got {nll_loss_coef}")


@dataclass
class DPOTask:
    """Direct preference optimisation against `ref` (`--beta`, `--ipo`, `--label_smoothing`, `--nll_loss_coef`)."""

    pad_token_id: int
    ref: FrozenModel
    beta: float = default_of(BetaFlags, "beta")
    label_smoothing: float = default_of(DPOFlags, "label_smoothing")
    ipo: bool = default_of(DPOFlags, "ipo")
    nll_loss_coef: float = default_of(DPOFlags, "nll_loss_coef")
    packing: bool = False
    device: torch.device | str = "cpu"
    dist: DistInfo = field(default_factory=DistInfo)  # whose dp group reduces the metrics
    vision: VisionContext | None = None  # a VLM's picture processing: both sides of a pair show its pictures
    TOKEN_ADDITIVE = False  # a loss over pairs / samples: the loop sums its metrics over the dp group

    def __post_init__(self) -> None:
        check_dpo_settings(self.beta, self.label_smoothing, self.ipo, self.nll_loss_coef)

    def collate(self, items: Sequence[PreferenceItem]) -> PairBatch:
        pictures = self.vision.inputs_of if self.vision is not None else None
        return collate_pairs(items, self.pad_token_id, self.packing, pictures).to(self.device)

    def count(self, batch: PairBatch) -> float:
        return float(batch.num_pairs)

    def _pair_terms(self, model: torch.nn.Module, batch: PairBatch, count: float
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss over `count` pairs and per-pair tensors (`[B]`) for the metrics."""
        with self.ref.use() as ref_model:
            ref_lp, _ = sequence_logps(ref_model, batch.seqs)
        lp, ntok = sequence_logps(model, batch.seqs)
        b = batch.num_pairs
        chosen_nll = -lp[:b] / ntok[:b].clamp(min=1.0) if self.nll_loss_coef else None
        loss, _ = dpo_loss(lp[:b], lp[b:], ref_lp[:b], ref_lp[b:], beta=self.beta,
                           label_smoothing=self.label_smoothing, ipo=self.ipo, num_samples=count,
                           chosen_nll=chosen_nll, nll_loss_coef=self.nll_loss_coef, sync_metrics=False)
        ratio = (lp.detach().float() - ref_lp.float()) * self.beta
        rc, rr = ratio[:b], ratio[b:]
        per = {"chosen_reward": rc, "rejected_reward": rr, "acc": (rc > rr).float(), "margin": rc - rr}
        if chosen_nll is not None:
            per["nll_loss"] = chosen_nll.detach().float()
        return loss, per

    def loss(self, model: torch.nn.Module, batch: PairBatch, global_count: float
             ) -> tuple[Tensor, MicroMetrics]:
        loss, per = self._pair_terms(model, batch, global_count)
        g = max(global_count, 1.0)
        keys = list(per)
        # device tensors, read by the loop after the optimizer step (in double, as python floats would be)
        sums = torch.stack([loss.detach().float()] + [per[k].sum() for k in keys]).double().unbind()
        metrics = {"loss": sums[0], **{k: v / g for k, v in zip(keys, sums[1:])}}
        if "nll_loss" in per:
            metrics["preference_loss"] = metrics["loss"] - self.nll_loss_coef * metrics["nll_loss"]
        return loss, metrics

    @torch.no_grad()
    def eval_metrics(self, model: torch.nn.Module, batches: list[PairBatch]) -> dict[str, float]:
        """eval/loss, eval/acc, eval/chosen_reward, eval/rejected_reward, eval/margin (means over pairs)."""
        names = ["loss", "chosen_reward", "rejected_reward", "acc", "margin"]
        sums = torch.zeros(len(names) + 1, dtype=torch.float64)
        for b in batches:
            loss_sum, per = self._pair_terms(model, b, 1.0)  # count 1: the sum over pairs
            vals = [loss_sum.detach()] + [per[k].sum() for k in names[1:]]
            sums += torch.tensor([float(v) for v in vals] + [float(b.num_pairs)], dtype=torch.float64)
        sums = self.dist.all_reduce_dp(sums)
        n = float(sums[-1].clamp(min=1.0))
        return {f"eval/{k}": float(v) / n for k, v in zip(names, sums[:-1].tolist())}
