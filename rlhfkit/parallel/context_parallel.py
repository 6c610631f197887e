"""Context parallelism (`--ring_attn_size N`): a Hugging Face model runs each sequence split over a ring.

    backend.model(input_ids [B, L], attention_mask / position_ids)       (any caller: roles, tasks)
      |  _Plan: drop padding, pack the rows into one row of T real tokens (cu_seqlens from the rows,
      |  or from packed position ids), pad T to a multiple of 2N, zig-zag split: this rank's t = T'/N
      v
    model(local ids [1, t], local position ids, rlhfkit_ring=RingCall)   RoPE sees global positions;
      |  every attention layer: ring_attention over the cp group           the attention function
      v                                                                    "rlhfkit_ring" (below)
    per-token outputs [1, t, ...] --gather_ring (autograd)--> [1, T] --> [B, L, ...] (0 at padding)

`apply_cp(model, group, head_stride)` installs this on a module: the attention implementation is
switched to "rlhfkit_ring" (registered in transformers' AttentionInterface; its mask builder returns
None: the ring builds its mask from global positions and cu_seqlens), `model.forward` is wrapped to
split and gather as above, and `model.rlhfkit_context_parallel` is set, which
`rlhfkit.models.forward.token_logprobs` looks for: the log-prob path computes the per-token
log-probs on the local tokens and gathers only those `[T]` floats.
The next-token targets are taken on the full packed row *before* the split (the label of a shard's
last token lives on the next shard); the shift back to `logprobs[:, t] = log p(ids[t] | ids[:t])`
is done after the gather, and sample starts / padding are zeroed as without context parallelism.

So every caller sees exactly the tensors it saw without context parallelism (log-probs, entropy,
values, reward-model values, logits) and computes the same loss on every cp rank. The gather's
backward keeps only this rank's slice of the gradient: parameter gradients of the cp ranks are
partial sums over their tokens, and FSDP2 shards over the flattened dp_shard x cp mesh
(`fsdp_mesh`), so its reduce-scatter (a SUM, sharding.py) completes them over cp and adds the dp
ranks. Reductions of metrics stay over dp (the loss group is the dp group; docs/parallelism.md).

A mixture-of-experts router loss (--aux_loss_coef) is computed by each rank on its own tokens and
replaced by its mean over the ring (`_ring_mean`): the load-balancing loss is not additive over tokens,
so this approximates the whole-sequence value (exact for the language-model loss, not for this term).

Limits: the per-token outputs (and, for `forward_logits` callers such as PRM and distillation, the
full logits) are gathered on every cp rank; attention dropout, sliding windows and KV caches are
not supported on the ring (a sliding-window config gets a note: attention is full causal). Model
families: Llama, Mistral, Qwen2, Qwen3 (and their MoE variants): they call attention through
transformers' AttentionInterface and pass forward keywords down to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as tdist
from torch import nn

from rlhfkit.parallel.ring_attention import ring_attention, split_for_ring, unsplit_ring
from rlhfkit.config.notes import note_once
from rlhfkit.models.hf_config import ConfigFields, config_of
from rlhfkit.models.forward import CONTEXT_PARALLEL_ATTR, _predicted_positions, segment_ids, target_logprobs

RING_ATTN_IMPL = "rlhfkit_ring"
RING_KWARG = "rlhfkit_ring"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
LAYOUT = "zigzag"


@dataclass
class RingCall:
    """What the attention layers of one forward pass need (passed down as the `rlhfkit_ring` keyword)."""

    group: Any
    cu_seqlens: torch.Tensor  # boundaries of the sequences in the full packed row
    head_stride: int | None
    layout: str = LAYOUT


def _ring_attention_fn(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any):
    """transformers attention function: q [1, Hq, t, D], k/v [1, Hkv, t, D] -> ([1, t, Hq, D], None)."""
    call = kwargs.get(RING_KWARG)
    if call is None:
        raise RuntimeError("ring attention was called without the context-parallel split: call the model with "
                           "input_ids (the backend's forward splits them over the --ring_attn_size group)")
    if query.shape[0] != 1:
        raise RuntimeError(f"ring attention expects one packed row, got a batch of {query.shape[0]}")
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [1, H, t, D] -> [t, H, D]
    out = ring_attention(q, k, v, call.group, scale=scaling, cu_seqlens=call.cu_seqlens, layout=call.layout,
                         head_stride=call.head_stride)
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register_ring_attention() -> None:
    """Register "rlhfkit_ring" with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(RING_ATTN_IMPL, _ring_attention_fn)
    AttentionMaskInterface.register(RING_ATTN_IMPL, _no_mask)


# ---------------------------------------------------------------------------------------------- gather

class _GatherRing(torch.autograd.Function):
    """All-gather the ring's parts [1, t, ...] -> the full [1, length, ...]; backward: this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, world: int, length: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(world)]
        tdist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.world = rank, world
        return unsplit_ring(parts, dim=1, layout=LAYOUT, length=length)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return split_for_ring(grad, ctx.rank, ctx.world, dim=1, layout=LAYOUT), None, None, None, None


class _Plan:
    """One batch's packing and split (module docstring). `flat` is the packed row [1, T] of real tokens."""

    def __init__(self, cp: "ContextParallel", input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None) -> None:
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("context parallelism needs input_ids [B, L] (inputs_embeds is not supported)")
        self.cp, self.shape, dev = cp, tuple(input_ids.shape), input_ids.device
        b, length = self.shape
        if position_ids is not None:
            position_ids = position_ids.expand(b, length)
        self.real: torch.Tensor | None
        if attention_mask is not None:
            self.real = attention_mask.bool()
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            lens = self.real.sum(-1)
            cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        else:
            self.real = None
            if position_ids is None:
                position_ids = torch.arange(length, device=dev).expand(b, length)
            # a new sequence at each row start and wherever packed positions do not step by 1
            starts = torch.nonzero((segment_ids(position_ids).diff(dim=-1, prepend=position_ids.new_full((b, 1), -1))
                                    != 0).reshape(-1)).flatten()
            cu = torch.cat([starts, starts.new_tensor([b * length])])
        self.flat_ids = self._flatten(input_ids)
        flat_pos = self._flatten(position_ids)
        self.total = self.flat_ids.shape[1]
        self.cu = cu.to(dtype=torch.int32, device=dev)
        self.local_ids = self.split(self.flat_ids)
        self.local_pos = self.split(flat_pos)
        self.call = RingCall(cp.group, self.cu, cp.head_stride)

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        return (x[self.real] if self.real is not None else x.reshape(-1))[None]

    def split(self, x: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
        """This rank's part of a packed-row tensor [1, T, ...] (padded to a multiple of 2N; at least 2N)."""
        if x.shape[1] == 0:  # an empty batch still runs the ring (every rank takes part)
            x = x.new_full((1, 1, *x.shape[2:]), pad_value)
        return split_for_ring(x, self.cp.rank, self.cp.world, 1, LAYOUT, pad_value)

    def gather_flat(self, local: torch.Tensor) -> torch.Tensor:
        """[1, t, ...] on each rank -> the packed row [1, T, ...] (differentiable)."""
        return _GatherRing.apply(local, self.cp.group, self.cp.rank, self.cp.world, self.total)

    def to_batch(self, flat: torch.Tensor) -> torch.Tensor:
        """Packed row [1, T, ...] -> [B, L, ...] of the input's layout (0 at padding)."""
        if self.real is None:
            return flat.reshape(*self.shape, *flat.shape[2:])
        out = flat.new_zeros((*self.shape, *flat.shape[2:]))
        return out.index_put((self.real,), flat[0])

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return self.to_batch(self.gather_flat(local))


def _own(t: torch.Tensor) -> torch.Tensor:
    """A module output that is not a view (FSDP2's pre-backward hook on a view would be lost to in-place ops)."""
    return t.clone() if t._is_view() else t


def next_token_targets(plan: _Plan) -> torch.Tensor:
    """[t] the token after each of this rank's tokens: shifted on the full packed row, THEN split (a
    shard's last token is followed by the first token of another shard)."""
    return plan.split(torch.roll(plan.flat_ids, shifts=-1, dims=1))[0]


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out[0])


class ContextParallel:
    """This rank's place in its ring and the hooks `apply_cp` installs (module docstring)."""

    def __init__(self, group: Any, head_stride: int | None = None) -> None:
        self.group, self.head_stride = group, head_stride
        self.rank, self.world = tdist.get_rank(group), tdist.get_world_size(group)

    def plan(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> _Plan:
        return _Plan(self, input_ids, attention_mask, position_ids)

    def wrap_forward(self, model: nn.Module) -> None:
        inner = model.forward  # the bound method of the class (FSDP2's hooks run around it in __call__)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if RING_KWARG in kwargs:  # already split (token_logprobs below): local outputs
                return self._mean_aux(inner(*args, **kwargs))
            for name, a in zip(("input_ids", "attention_mask", "position_ids"), args):
                kwargs[name] = a
            for bad in ("labels", "inputs_embeds", "past_key_values"):
                if kwargs.get(bad) is not None:
                    raise ValueError(f"--ring_attn_size: a forward with {bad} is not supported under context "
                                     "parallelism")
            if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
                raise ValueError("--ring_attn_size: hidden states / attentions are not gathered over the ring")
            plan = self.plan(kwargs.pop("input_ids", None), kwargs.pop("attention_mask", None),
                             kwargs.pop("position_ids", None))
            kwargs["use_cache"] = False
            out = inner(input_ids=plan.local_ids, position_ids=plan.local_pos, **{RING_KWARG: plan.call}, **kwargs)
            if isinstance(out, torch.Tensor):
                return _own(plan.gather(out))
            out.logits = _own(plan.gather(_first(out)))
            return self._mean_aux(out)

        model.forward = forward

    def _mean_aux(self, out: Any) -> Any:
        """A MoE model's output (a transformers ModelOutput, a mapping of its set fields) with its router
        loss averaged over the ring."""
        aux = out.get("aux_loss") if isinstance(out, Mapping) else None
        if isinstance(aux, torch.Tensor):
            out.aux_loss = self._ring_mean(aux)
        return out

    def _ring_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of `x` over the ring (the same value on every rank); its gradient is this rank's x / N,
        so the ranks' parameter gradients sum to the gradient of the mean."""
        total = x.detach().clone()
        tdist.all_reduce(total, group=self.group)
        return (x + (total - x.detach())) / self.world

    def token_logprobs(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                       return_entropy: bool = False, chunk_size: int | None = None, fused: bool = True) -> Any:
        """`rlhfkit.models.forward.token_logprobs` on the ring: log-probs (entropy) computed on the local
        tokens against targets shifted on the full row, gathered and shifted back; same result."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        plan = self.plan(input_ids, attention_mask, position_ids)
        targets = next_token_targets(plan)
        kw = {"input_ids": plan.local_ids, "position_ids": plan.local_pos, "use_cache": False, RING_KWARG: plan.call}
        # (`fused` is accepted for the same signature: the fused lm_head path never applies here, as
        # context parallelism implies FSDP2, whose sharded head `fusable_head` declines)
        lp, ent = target_logprobs(_first(model(**kw))[0], targets, temperature, return_entropy, chunk_size)
        keep = _predicted_positions(input_ids, attention_mask, position_ids)

        def full(x: torch.Tensor) -> torch.Tensor:
            flat = plan.gather_flat(x[None])  # [1, T]: value at token i predicts token i + 1
            shifted = torch.cat([flat.new_zeros(1, 1), flat[:, :-1]], dim=1)
            return torch.where(keep, plan.to_batch(shifted), 0.0)

        return (full(lp), full(ent)) if return_entropy else full(lp)


def check_cp_model(model: nn.Module, head_stride: int | None) -> None:
    """Raise (naming the flag) for a model the ring cannot run: family, or heads not divisible by the stride."""
    config: Any = config_of(model)  # a family's fields are read by name
    f = ConfigFields.of(config)
    mtype = f.model_type if config is not None else None
    if config is None or mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"--ring_attn_size: model type {mtype!r} is not supported by ring attention "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    kv = f.num_key_value_heads or config.num_attention_heads
    if head_stride is not None and (head_stride < 1 or kv % head_stride):
        raise ValueError(f"--ring_head_stride {head_stride} must divide the model's key/value heads ({kv})")
    if f.sliding_window and f.use_sliding_window:
        note_once(f"note: --ring_attn_size: the model's sliding window ({f.sliding_window}) is not applied on "
                  "the ring; attention is full causal")


def check_cp(model: nn.Module, dims: Any, head_stride: int | None, has_process_group: bool) -> None:
    """The backend's check before sharding: with cp > 1 the model must suit the ring and ranks must exist."""
    if dims.cp == 1:
        return
    check_cp_model(model, head_stride)
    if not has_process_group:
        raise ValueError(f"--ring_attn_size {dims.cp} needs a process group (torchrun or Ray)")


def apply_cp(model: nn.Module, group: Any, head_stride: int | None = None) -> ContextParallel:
    """Run `model` (an HF causal LM or rlhfkit value model, possibly FSDP2-wrapped) on the ring `group`."""
    check_cp_model(model, head_stride)
    if getattr(model.config, "attention_dropout", 0.0):
        note_once("note: --ring_attn_size: attention dropout is not applied on the ring")
    register_ring_attention()
    for m in model.modules():
        cfg = config_of(m)
        if cfg is not None:
            cfg._attn_implementation = RING_ATTN_IMPL
    cp = ContextParallel(group, head_stride)
    cp.wrap_forward(model)
    setattr(model, CONTEXT_PARALLEL_ATTR, cp)
    if cp.rank == 0 and tdist.get_rank() == 0:
        note_once(f"note: context parallelism: ring attention over {cp.world} ranks (--ring_attn_size), "
                  f"{head_stride or 'all'} key/value heads per ring pass (--ring_head_stride)")
    return cp


def fsdp_mesh(mesh: Any, dims: Any) -> Any:
    """The mesh FSDP2 shards over: dims.fsdp_dim_names, with dp_shard and cp flattened into "dp_shard_cp"
    when cp > 1 (so FSDP's gradient reduce-scatter also sums the cp ranks' partial gradients)."""
    if dims.cp == 1:
        return mesh[dims.fsdp_dim_names]
    flat = getattr(mesh, "_rlhfkit_dp_shard_cp", None)  # flattened once per mesh (a collective), then reused
    if flat is None:
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh._rlhfkit_dp_shard_cp = flat
    return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else flat
