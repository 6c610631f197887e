"""The policy (actor) and reference roles: a causal LM + backend with log-prob passes and PPO updates.

    forward_logprobs(batch)   -> [B, L] log pi(token_t | tokens_<t), no grad, in micro-batches
    train_on(batch)           -> metrics; `max_epochs` passes over the batch in mini-batches of
                                 `train_batch_size` (global samples per optimizer step), each
                                 split into `micro_train_batch_size` micro-batches
    weights()                 -> iterator of full (unsharded) `(name, tensor)` for the engine

Each optimizer step's losses divide by the step's global action-token count (all ranks), so a
step is the same whatever the micro-batching and the number of ranks. Two optional terms
(rlhfkit.losses.aux): the MoE router balance loss (`aux_loss_coef`, weighted by each
micro-batch's share of the action tokens) and PPO-ptx (`ptx`, `ptx_coef`: one pretraining
micro-batch per policy micro-batch, its NLL divided by the step's global count of pretraining
tokens; backward separately, so the two graphs are never alive together). A reference model
with `offload` keeps its weights in host memory between its passes (`--ref_offload`).

Vision-language rows (`batch.images`) go through the model with their pictures and 3-D positions
(rlhfkit.models.vlm); such micro-batches are padded, never packed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from contextlib import AbstractContextManager
from typing import Any, Iterator, Protocol, runtime_checkable

import torch

from rlhfkit.config.configs import BackendFlags, ModelFlags, SamplingFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.rl_flags import AlgoFlags
from rlhfkit.algo.kl import compute_approx_kl
from rlhfkit.backend.base import TrainBackend
from rlhfkit.data.collate import PaddedBatch
from rlhfkit.data.ptx import PtxBatches
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config.notes import note_once
from rlhfkit.losses.aux import ptx_loss, router_aux_loss
from rlhfkit.losses.kl import kl_loss
from rlhfkit.losses.policy import PolicyLossConfig, policy_loss
from rlhfkit.losses.reduce import to_floats
from rlhfkit.models.moe import RouterAuxLoss
from rlhfkit.models.vlm import VisionLayout, batch_forward_kwargs, layout_of_model, with_picture_row
from rlhfkit.types import ExperienceBatch


@runtime_checkable
class AdapterModel(Protocol):
    """A PEFT (LoRA) model, whose adapters can be switched off for a block."""

    def disable_adapter(self) -> AbstractContextManager[Any]: ...


@dataclass
class UpdateConfig:
    """How one role trains on a rollout (flags in brackets)."""

    train_batch_size: int  # global samples per optimizer step [--train_batch_size]
    micro_train_batch_size: int  # [--micro_train_batch_size]
    max_epochs: int = 1  # [--max_epochs]
    seed: int = default_of(BackendFlags, "seed")
    # log-probs use the sampling temperature [--temperature]
    temperature: float = default_of(SamplingFlags, "temperature")
    use_kl_loss: bool = default_of(AlgoFlags, "use_kl_loss")  # [--use_kl_loss]
    kl_estimator: str = default_of(AlgoFlags, "kl_estimator")  # [--kl_estimator]
    compute_entropy: bool = True
    max_tokens_per_micro: int | None = None  # token-budget micro-batches [--use_dynamic_batch --train_max_tokens_per_gpu]
    packing: bool = False  # policy/reference passes pack a micro-batch's rows into one [--packing_samples];
    # the critic and reward model run padded micro-batches
    aux_loss_coef: float = default_of(ModelFlags, "aux_loss_coef")  # MoE router balance loss [--aux_loss_coef]
    ptx_coef: float = 0.0  # PPO-ptx weight, with a pretraining source [--ptx_coef --pretrain_data]


def global_max(x: int, dist: DistInfo) -> int:
    """Max of `x` over every rank (a count of forward passes: all ranks must agree on it)."""
    return int(dist.all_reduce_world(x, op="max"))


def dummy_like(batch: ExperienceBatch) -> ExperienceBatch:
    """A one-row batch with nothing to train on, so a rank with no rows still joins the collectives."""
    if batch.batch_size:
        d = batch.select([0])
    else:
        z = torch.zeros((1, 2), dtype=torch.long)
        d = ExperienceBatch(input_ids=z.clone(), attention_mask=torch.ones_like(z), loss_mask=z.clone())
        for k in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "values", "returns", "advantages"):
            if getattr(batch, k) is not None:
                setattr(d, k, torch.zeros((1, 2)))
    d.loss_mask = torch.zeros_like(d.loss_mask)
    return d


def micro_batches(batch: ExperienceBatch, size: int, dist: DistInfo, aligned: bool = True,
                  max_tokens: int | None = None) -> Iterator[tuple[ExperienceBatch, int]]:
    """`(micro_batch, real_rows)` pairs of consecutive rows: at most `size` rows, or, with
    `max_tokens` (dynamic batching), as many rows as fit that many real tokens.

    With `aligned`, every rank yields the same number of micro-batches (the max over ranks), padding
    with empty (fully masked) ones: sharded models need the same number of forward/backward passes
    on every rank.
    """
    if max_tokens:
        from rlhfkit.data.collate import split_by_token_budget

        groups = split_by_token_budget(batch.attention_mask.sum(-1).tolist(), max_tokens)
    else:
        groups = [list(range(i, min(i + size, batch.batch_size))) for i in range(0, batch.batch_size, size)]
    n = global_max(len(groups), dist) if aligned else len(groups)
    for i in range(n):
        rows = groups[i] if i < len(groups) else []
        yield (trim(batch.select(rows)), len(rows)) if rows else (dummy_like(batch), 0)


def row_logprobs(backend: TrainBackend, mb: ExperienceBatch, temperature: float, entropy: bool, packed: bool,
                 layout: VisionLayout | None = None, tower_every_pass: bool = False):
    """Log-probs (and entropy) `[B, L]` of a right-padded micro-batch through `backend.token_logprobs`;
    `packed` runs its rows as one packed row (positions restart per sample, no cross-sample
    attention) and scatters back. A VLM (`layout`) with rows that carry pictures runs padded, with
    the pictures and the 3-D positions; `tower_every_pass` (several ranks) adds a blank-picture row to
    a micro-batch without pictures, so every rank runs the vision tower (`with_picture_row`)."""
    has_pictures = mb.images is not None and any(i is not None for i in mb.images)
    if layout is not None and (has_pictures or tower_every_pass):
        ids, mask, images = mb.input_ids, mb.attention_mask, mb.images
        if not has_pictures:
            ids, mask, images = with_picture_row(ids, mask, images, layout)
        assert images is not None  # the rows' own pictures, or the blank row's
        kw = batch_forward_kwargs(ids, mask, images, layout)
        res = backend.token_logprobs(ids, attention_mask=mask, position_ids=kw.pop("position_ids"),
                                     temperature=temperature, return_entropy=entropy, model_kwargs=kw)
        if has_pictures:
            return res
        width = mb.input_ids.shape[1]
        return tuple(t[:-1, :width] for t in res) if entropy else res[:-1, :width]
    if not packed:
        return backend.token_logprobs(mb.input_ids, attention_mask=mb.attention_mask, temperature=temperature,
                                      return_entropy=entropy)
    real = mb.attention_mask.bool()
    lens = real.sum(-1)
    pos = torch.cat([torch.arange(int(n), device=mb.input_ids.device) for n in lens.tolist()])[None]
    res = backend.token_logprobs(mb.input_ids[real][None], position_ids=pos, temperature=temperature,
                                 return_entropy=entropy)
    parts = res if entropy else (res,)
    outs = []
    for t in parts:
        full = t.new_zeros(mb.input_ids.shape)
        full[real] = t[0]
        outs.append(full)
    return tuple(outs) if entropy else outs[0]


def trim(batch: ExperienceBatch) -> ExperienceBatch:
    """Drop the padding columns that no row of this (right-padded) batch uses."""
    used = int(batch.attention_mask.sum(-1).max().item()) if batch.batch_size else 0
    if used == batch.input_ids.shape[1]:
        return batch
    out: dict[str, Any] = {k: (v[:, :used] if isinstance(v, torch.Tensor) and v.dim() == 2 else v)
                           for k, v in batch.__dict__.items()}
    return ExperienceBatch(**out)


def mini_batches(batch: ExperienceBatch, train_batch_size: int, epoch: int, seed: int,
                 dist: DistInfo) -> list[ExperienceBatch]:
    """This rank's rows shuffled by (seed, epoch) and cut into as many mini-batches as the *global*
    rollout needs (ceil(global rows / train_batch_size)), the same number on every rank."""
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    order = torch.randperm(batch.batch_size, generator=g).tolist()
    total = int(dist.all_reduce_dp(torch.tensor(float(batch.batch_size), dtype=torch.float64)).item())
    n = max(1, -(-total // train_batch_size))
    k, r = divmod(len(order), n)
    out, start = [], 0
    for i in range(n):
        end = start + k + (1 if i < r else 0)
        out.append(batch.select(order[start:end]))
        start = end
    return out


def average(records: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in records for k in r}
    return {k: sum(r[k] for r in records if k in r) / max(1, sum(1 for r in records if k in r)) for k in keys}


def reduce_over_ranks(metrics: dict[str, float], sum_keys: tuple[str, ...], dist: DistInfo) -> dict[str, float]:
    """This rank's metrics -> the global ones, over the loss group (the dp group: each of its ranks
    computed them from its own rows; cp ranks gather their outputs, docs/parallelism.md): `sum_keys`
    (losses already divided by a global count, so each rank holds a part) are summed, the others
    (local means) averaged."""
    size = dist.loss_size
    if size == 1:
        return metrics
    keys = sorted(metrics)
    tot = dist.all_reduce_loss(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)).tolist()
    return {k: v if k in sum_keys else v / size for k, v in zip(keys, tot)}


class ActorRole:
    """Policy (trainable) or reference (frozen: `backend.optimizer is None`) model."""

    def __init__(self, backend: TrainBackend, dist: DistInfo, loss_cfg: PolicyLossConfig | None = None,
                 update_cfg: UpdateConfig | None = None, micro_rollout_batch_size: int = 8,
                 rollout_max_tokens: int | None = None, packing: bool = False, ptx: PtxBatches | None = None,
                 offload: bool = False, adapters_off: bool = False) -> None:
        """`ptx`: a `rlhfkit.data.ptx.PtxBatches` (PPO-ptx); `offload`: a frozen model's weights
        stay in host memory between forward passes; `adapters_off`: a reference that shares the LoRA
        policy's backend and runs it with the adapters disabled (its log-probs are the base model's)."""
        self.backend, self.dist = backend, dist
        self.loss_cfg, self.update_cfg = loss_cfg, update_cfg
        self.micro_rollout_batch_size = micro_rollout_batch_size
        self.rollout_max_tokens = rollout_max_tokens  # [--rollout_max_tokens_per_gpu] with --use_dynamic_batch
        self.packing = packing
        self.ptx = ptx
        self.offload = offload and backend.optimizer is None
        self.adapters_off = adapters_off
        self.layout = layout_of_model(backend.unwrap())  # a VLM's: its rows may carry pictures
        self.tower_every_pass = self.layout is not None and dist.world_size > 1
        self.device = torch.device(dist.device)
        if self.offload:
            backend.offload_states()

    @torch.no_grad()
    def forward_logprobs(self, batch: ExperienceBatch, temperature: float = 1.0) -> torch.Tensor:
        if self.offload:
            self.backend.reload_states()
        self.backend.eval()
        # filled on the device and copied to the host once: a copy per micro-batch would wait for
        # the GPU each time, and the next micro-batch's launches could not queue behind the last
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        row = 0
        with self._adapters_disabled():
            for mb, real in micro_batches(batch, self.micro_rollout_batch_size, self.dist,
                                          max_tokens=self.rollout_max_tokens):
                mb = mb.to(self.device, non_blocking=True)
                lp = row_logprobs(self.backend, mb, temperature, False, self.packing, self.layout,
                                  self.tower_every_pass)
                out[row:row + real, :lp.shape[1]] = (lp.float() * mb.attention_mask)[:real]
                row += real
        out = out.cpu()
        if self.offload:
            self.backend.offload_states()
        return out

    def _adapters_disabled(self) -> AbstractContextManager[Any]:
        """With `adapters_off`, the block runs the shared LoRA policy as its base model."""
        if not self.adapters_off:
            return contextlib.nullcontext()
        model = self.backend.unwrap()
        if not isinstance(model, AdapterModel):
            raise TypeError(f"adapters_off: the policy's model ({type(model).__name__}) has no adapters to switch off")
        return model.disable_adapter()

    def train_on(self, batch: ExperienceBatch, kl_coef: float = 0.0) -> dict[str, float]:
        """PPO epochs over `batch` (this rank's rows); returns metrics averaged over steps."""
        cfg = self.update_cfg
        assert cfg is not None and self.loss_cfg is not None, "a reference model does not train"
        self.backend.train()
        records = []
        for epoch in range(cfg.max_epochs):
            minis = mini_batches(batch, cfg.train_batch_size, epoch, cfg.seed, self.dist)
            if batch.old_logprobs is None and (cfg.max_epochs > 1 or len(minis) > 1):
                raise ValueError("old log-probs may come from the training pass only when the rollout makes one "
                                 f"optimizer step ({cfg.max_epochs} epoch(s) x {len(minis)} mini-batch(es) here)")
            for mini in minis:
                records.append(self._step(mini, kl_coef))
        skipped = sum(r.pop("nonfinite_skipped") for r in records)  # the same on every rank
        out = reduce_over_ranks(average(records), ADDITIVE, self.dist)
        out["nonfinite_skipped"] = skipped
        return out

    def _train_cfg(self) -> UpdateConfig:
        if self.update_cfg is None:
            raise RuntimeError("a reference model does not train (its ActorRole has no update_cfg)")
        return self.update_cfg

    def _step(self, mini: ExperienceBatch, kl_coef: float) -> dict[str, float]:
        cfg, loss_cfg = self._train_cfg(), self.loss_cfg
        assert loss_cfg is not None, "a reference model does not train"
        # counted on whole rows (this rank's share of the samples): summed over dp, not cp
        counts = self.dist.all_reduce_dp(torch.tensor([float(mini.loss_mask.sum()),
                                                       float((mini.loss_mask.sum(-1) > 0).sum())], dtype=torch.float64))
        num_tokens, num_seqs = float(counts[0]), float(counts[1])
        sums: dict[str, Any] = {}
        mbs = list(micro_batches(mini, cfg.micro_train_batch_size, self.dist, max_tokens=cfg.max_tokens_per_micro))
        ptx = self._ptx_batches(len(mbs))
        # metrics stay device tensors until the step ends: a host sync per micro-batch would idle the
        # GPU while the next forward is launched
        for i, (mb_host, _) in enumerate(mbs):
            mb_tokens = float(mb_host.loss_mask.sum())
            mb = mb_host.to(self.device, non_blocking=True)
            with RouterAuxLoss(self.backend.model, enabled=cfg.aux_loss_coef != 0) as router:
                res = row_logprobs(self.backend, mb, cfg.temperature, cfg.compute_entropy, cfg.packing, self.layout,
                                   self.tower_every_pass)
            lp, ent = res if cfg.compute_entropy else (res, None)
            # one optimizer step per rollout: the policy scoring these samples is the old one (ratio 1)
            old = mb.old_logprobs if mb.old_logprobs is not None else lp.detach()
            assert mb.advantages is not None, "train_on takes a batch with advantages (finish_experience)"
            loss, pm = policy_loss(lp, old, mb.advantages, mb.loss_mask, loss_cfg,
                                   num_tokens=num_tokens, num_sequences=num_seqs,
                                   rollout_logprobs=mb.rollout_logprobs, entropy=ent, sync_metrics=False)
            m: dict[str, torch.Tensor | float] = dict(pm)  # device tensors until the step ends
            if cfg.use_kl_loss and mb.ref_logprobs is not None and kl_coef > 0:
                kl_l, km = kl_loss(lp, mb.ref_logprobs, mb.loss_mask, estimator=cfg.kl_estimator,
                                   num_tokens=num_tokens, sync_metrics=False)
                loss = loss + kl_coef * kl_l
                m["kl_loss"] = km["kl_loss"]  # its "kl" (a micro-batch mean) would hide the loop's rollout `kl`
            if mb.old_logprobs is None and mb.ref_logprobs is not None:  # the rollout's KL to the reference
                kl_tok = compute_approx_kl(old, mb.ref_logprobs, cfg.kl_estimator, mask=mb.loss_mask)
                m["kl"] = (kl_tok * mb.loss_mask).sum() / max(num_tokens, 1.0)
            loss = self._add_router_loss(router.take(), loss, m, mb_tokens, num_tokens)
            self.backend.backward(loss)
            if ptx is not None:
                m.update(self._ptx_backward(ptx[0][i], ptx[1]))
            for k, v in m.items():
                sums[k] = sums[k] + v if k in sums else v
        sums = to_floats(sums)
        out = {k: v / max(len(mbs), 1) for k, v in sums.items()}
        # losses are global-count normalised: their micro-batch sum is the step's loss
        for k in ADDITIVE:
            if k in sums:
                out[k] = sums[k]
        stats = self.backend.optimizer_step()
        out["grad_norm"] = stats.get("grad_norm", float("nan"))
        out["actor_lr"] = stats.get("lr", float("nan"))
        out["nonfinite_skipped"] = stats.get("nonfinite_skipped", 0.0)
        return out

    def _add_router_loss(self, aux: torch.Tensor | None, loss: torch.Tensor, m: dict[str, torch.Tensor | float],
                         tokens: float, num_tokens: float) -> torch.Tensor:
        coef = self._train_cfg().aux_loss_coef
        if aux is None:
            if coef:
                note_once("note: --aux_loss_coef has no effect: the policy returns no router load-balancing loss "
                          "(not a mixture-of-experts causal LM)")
            return loss
        aux_l, aux_m = router_aux_loss(aux, coef, tokens, num_tokens)
        m.update(aux_m)
        return loss + aux_l

    def _ptx_batches(self, n: int) -> tuple[list[PaddedBatch], float] | None:
        """This optimizer step's `n` pretraining micro-batches and their global loss-token count."""
        cfg = self._train_cfg()
        if self.ptx is None or not cfg.ptx_coef:
            return None
        per_step = max(1, cfg.train_batch_size // (cfg.micro_train_batch_size * self.dist.dp_size))
        first = self.backend.steps_done * per_step
        batches = [self.ptx.batch(first + i) for i in range(n)]
        count = self.dist.all_reduce_dp(torch.tensor(float(sum(b.num_loss_tokens for b in batches)),
                                                     dtype=torch.float64))
        return batches, float(count)

    def _ptx_backward(self, batch: PaddedBatch, num_tokens: float) -> dict[str, float]:
        """Backward of ptx_coef x the pretraining NLL of one micro-batch (PPO-ptx)."""
        b = batch.to(self.device)
        lp = self.backend.token_logprobs(b.input_ids, attention_mask=b.attention_mask)
        loss, m = ptx_loss(lp, b.loss_mask, self._train_cfg().ptx_coef, num_tokens)
        self.backend.backward(loss)
        return m

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.backend.named_full_params()


ADDITIVE = ("policy_loss", "kl_loss", "aux_loss", "ptx_loss", "kl")  # divided by global counts: summed, not averaged
