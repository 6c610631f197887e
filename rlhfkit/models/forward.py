"""Per-token log-probs and entropy of a causal LM, for padded and packed batches.

Alignment (docs/architecture.md): `logprobs[:, t] = log p(ids[:, t] | ids[:, :t])`, 0 at the
first token of every sample (t = 0, the first real token of a left-padded row, every packed
sample start) and at padding; `entropy[:, t]` is the entropy of the distribution that
predicted token t, aligned the same way.

Two batch layouts:

    padded  input_ids [B, L] + attention_mask [B, L] (position_ids default to cumsum(mask) - 1)
    packed  input_ids [1, T] + position_ids [1, T] restarting at 0 per sample, attention_mask None

Packed rows must not attend across samples. How that is ensured (`packed_mask`):

* "auto": flash_attention_* -> HF derives varlen boundaries from position_ids; sdpa/eager/...
  -> transformers >= 4.56 detects packed position_ids itself when attention_mask is None and
  no cache is used (`masking_utils.find_packed_sequence_indices`; checked by
  tests/parity/test_packing.py against a padded batch); older versions -> "block".
* "block": we build a block-diagonal causal mask `[B, 1, T, T]` (O(T^2) memory; for models
  whose code does not go through `create_causal_mask`); a model whose config names layer types
  gets one per type (`layer_type_masks`: the sliding layers' within their window). "auto" takes
  this path too for sliding-window models and for models whose mask builder is not given the
  positions (`MASK_WITHOUT_POSITIONS`: gpt-oss), where transformers cannot see the boundaries.
* "hf": position_ids only, whatever the attention implementation.

Positions keep attention layers apart, nothing else: a layer that carries a state along the sequence
(linear attention such as Qwen3.5's gated delta rule, state-space and convolution layers) would run
it from one packed sample into the next. `packing_refusal(config)` names such a model, and the
commands then run its samples padded, with one line saying so (rlhfkit.cli.common.check_packing).

Vision-language models take their pictures as `model_kwargs` (`pixel_values`, `image_grid_thw`,
rlhfkit.models.vlm.batch_forward_kwargs) and 3-D `position_ids` `[3, B, L]` with the padded layout.

Context parallelism (--ring_attn_size): a model the backend prepared for it carries
`rlhfkit_context_parallel` (`CONTEXT_PARALLEL_ATTR`), and `token_logprobs` hands the call to it
(rlhfkit.parallel.context_parallel): same arguments, same result, sequences split over the ring.

Memory: the model's logits `[B, L, V]` (in the model dtype) are the only full-vocabulary
tensor; log-softmax, the gather and the entropy run in fp32 on row chunks, and the backward pass
recomputes the softmax per chunk instead of keeping fp32 copies (`TokenLogprobFn`). Under tensor
parallelism each rank holds only its vocabulary shard of the logits and `token_logprobs` combines
the shards' statistics (vocab_parallel.py); `forward_logits` gathers them for callers that need
the full distribution (distillation, PRM).
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch

from rlhfkit.models.fused_logprobs import fusable_head, fused_shifted_logprobs, head_bypassed
from rlhfkit.models.vocab_parallel import chunk_rows, vocab_parallel_logprobs, vocab_sharded

PACKED_MASK_MODES = ("auto", "block", "hf")
# a model trained with context parallelism carries its splitter under this attribute (set by the backend)
CONTEXT_PARALLEL_ATTR = "rlhfkit_context_parallel"
# layers carrying a state along the sequence: kinds of a config's `layer_types`, and families made of them
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "recurrent")
RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "bamba",
                         "falcon_h1", "nemotron_h", "granitemoehybrid", "zamba", "zamba2", "lfm2", "lfm2_moe")


def packing_refusal(config: Any) -> str | None:
    """Why packed rows would not be exact for the model of transformers `config` (None: they are):
    its layers of a kind that carries a state along the sequence (module docstring)."""
    text = config.get_text_config()  # a vision-language model's language model
    model_type = getattr(text, "model_type", "")
    kinds = sorted({str(t) for t in getattr(text, "layer_types", None) or () if t in RECURRENT_LAYER_TYPES})
    if not kinds and model_type not in RECURRENT_MODEL_TYPES:
        return None
    layers = f"{', '.join(kinds)} layers" if kinds else "recurrent (state-space) layers"
    return f"model_type {model_type!r} has {layers}, whose state would run from one packed sample into the next"


# ----------------------------------------------------------------------------- log-softmax kernel


class TokenLogprobFn(torch.autograd.Function):
    """Row-chunked `log_softmax(z)[target]` and entropy, z = logits / T, in fp32.

    Gradients (p = softmax(z), H = -sum_i p_i log p_i):
        d logp_target / dz_j = 1[j = target] - p_j
        d H / dz_j           = -p_j (log p_j + H)
    and dz/dlogits = 1/T. Only the logits, targets, logsumexp and entropy (`[N]`) are saved.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        lp = logits.new_empty(n, dtype=torch.float32)
        ent = logits.new_zeros(n if with_entropy else 0, dtype=torch.float32)
        lse = logits.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            z = _scaled(logits[s: s + chunk], temperature)
            lse[s: s + chunk] = torch.logsumexp(z, dim=-1)
            lp[s: s + chunk] = z.gather(-1, targets[s: s + chunk, None]).squeeze(-1) - lse[s: s + chunk]
            if with_entropy:
                logp = z - lse[s: s + chunk, None]
                ent[s: s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple[Any, ...]:
        logits, targets, lse, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            sl = slice(s, s + chunk)
            z = _scaled(logits[sl], t)
            logp = z - lse[sl, None]
            p = torch.exp(logp)
            gz = -p * g_lp[sl, None]
            gz.scatter_add_(-1, targets[sl, None], g_lp[sl, None])
            active = g_lp[sl] != 0
            if ctx.with_entropy:
                gz = gz - p * (logp + ent[sl, None]) * g_ent[sl, None]
                active = active | (g_ent[sl] != 0)
            # rows without gradient stay exactly 0 (never NaN * 0 from padding rows)
            grad[sl] = torch.where(active[:, None], gz / t, 0.0).to(grad.dtype)
        return grad, None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                         return_entropy: bool = False, chunk_size: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shifted log-probs `[B, L]` (and entropy) from logits `[B, L, V]`; column 0 is 0.

    Row t of the logits predicts token t + 1; the result is shifted so that column t holds
    `log p(input_ids[:, t] | input_ids[:, :t])`. Start-of-sample and padding positions are not
    zeroed here (see `token_logprobs`).
    """
    b, length, vocab = logits.shape
    targets = torch.roll(input_ids, shifts=-1, dims=1).reshape(-1)  # last column: unused
    lp, ent = target_logprobs(logits.reshape(b * length, vocab), targets, temperature, return_entropy, chunk_size)
    zero = lp.new_zeros(b, 1)
    lp = torch.cat([zero, lp.view(b, length)[:, :-1]], dim=1)
    if not return_entropy:
        return lp, None
    return lp, torch.cat([zero, ent.view(b, length)[:, :-1]], dim=1)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    return_entropy: bool = False, chunk_size: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N]` log-probs of `targets` `[N]` under logits `[N, V]` (and entropy, `[0]` when not asked), no shift."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return TokenLogprobFn.apply(logits, targets, float(temperature), chunk_rows(logits.shape[-1], chunk_size),
                                return_entropy)


# ----------------------------------------------------------------------------- model call


def hf_detects_packing() -> bool:
    """Whether this transformers derives packed-sample boundaries from position_ids itself."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """`[B, T]` sample index of each packed token: a new sample starts where positions do not step by 1."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive mask `[B, 1, T, T]`: 0 where query i may see key j (same sample, j <= i, and with a
    sliding `window` i - j < window), else -inf-ish."""
    seg = segment_ids(position_ids)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    if window is not None:
        causal &= ~torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril(-window)
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


# model types whose mask builder is not given the position_ids (transformers then cannot see the
# packed samples' boundaries): their packed rows always get rlhfkit's own masks
MASK_WITHOUT_POSITIONS = ("gpt_oss",)


def layer_type_masks(model: torch.nn.Module, position_ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """transformers' per-layer-type mask mapping for packed rows (`block_causal_mask` per type, the
    sliding layers within their window), for a model whose config names layer types; else None."""
    config = getattr(model, "config", None)
    types = set(getattr(config, "layer_types", None) or ())
    if not types:
        return None
    dtype, window = _model_dtype(model), getattr(config, "sliding_window", None)
    return {t: block_causal_mask(position_ids, dtype, window if t == "sliding_attention" else None) for t in types}


def _own_packed_masks(model: torch.nn.Module) -> bool:
    """Whether packed rows need rlhfkit's masks under "auto": sliding-window layers (each layer type
    its own mask), or a model whose mask builder does not see the positions."""
    config = getattr(model, "config", None)
    types = set(getattr(config, "layer_types", None) or ())
    return "sliding_attention" in types or getattr(config, "model_type", "") in MASK_WITHOUT_POSITIONS


def _attn_impl(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", "") or "")


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def causal_only_masks(model: torch.nn.Module) -> dict[str, None] | None:
    """transformers' per-layer-type mask mapping that means "causal, nothing masked" (`None` for
    every layer type: SDPA / flash attention then run `is_causal`), where the model takes one: every
    layer full attention (no sliding window) and an SDPA or flash attention implementation. Else None."""
    config = getattr(model, "config", None)
    types = set(getattr(config, "layer_types", None) or ())
    impl = _attn_impl(model)
    if types != {"full_attention"} or not (impl == "sdpa" or "flash" in impl):
        return None
    return {"full_attention": None}


def forward_kwargs(model: torch.nn.Module, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor | None, packed_mask: str = "auto") -> dict[str, Any]:
    """Keyword arguments (besides input_ids) for a padded or packed forward pass without cache."""
    if packed_mask not in PACKED_MASK_MODES:
        raise ValueError(f"packed_mask must be one of {PACKED_MASK_MODES}, got {packed_mask!r}")
    kw: dict[str, Any] = {"use_cache": False}
    if attention_mask is not None:  # padded rows
        if position_ids is None and getattr(attention_mask, "_rlhfkit_no_padding", False) \
                and (masks := causal_only_masks(model)) is not None:
            # no padding (data/collate.py knew it on the host): the model's own positions 0..L-1 and
            # plain causal attention, what this mask gives, without the model inspecting the mask on
            # the GPU (transformers' mask builders read `mask.all()`: a host sync every forward)
            return {**kw, "attention_mask": masks}
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return {**kw, "attention_mask": attention_mask, "position_ids": position_ids}
    if position_ids is None:
        return kw
    impl = _attn_impl(model)
    use_block = packed_mask == "block" or (
        packed_mask == "auto" and "flash" not in impl and (not hf_detects_packing() or _own_packed_masks(model)))
    if use_block:
        if "flash" in impl or impl == "flex_attention":
            raise ValueError(f"packed_mask='block' needs an sdpa/eager model, not {impl!r}")
        masks = layer_type_masks(model, position_ids)
        return {**kw, "attention_mask": masks if masks is not None else block_causal_mask(position_ids, _model_dtype(model)),
                "position_ids": position_ids}
    return {**kw, "position_ids": position_ids}


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, packed_mask: str = "auto",
                   gather: bool = True, model_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """The model's logits `[B, L, V]` for a padded or packed batch. Under tensor parallelism the
    `lm_head` returns vocabulary-sharded logits (a DTensor); `gather` makes them a plain full
    tensor (differentiable all-gather), else they are returned as they are. `model_kwargs` go to
    the model as they are (a VLM's pictures)."""
    out = model(input_ids=input_ids, **forward_kwargs(model, attention_mask, position_ids, packed_mask),
                **(model_kwargs or {}))
    logits = out.logits if hasattr(out, "logits") else out[0]
    if gather and hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return logits


@overload
def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                   return_entropy: Literal[False] = False, chunk_size: int | None = None,
                   packed_mask: str = "auto", fused: bool = True, model_kwargs: dict[str, Any] | None = None
                   ) -> torch.Tensor: ...


@overload
def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, temperature: float = 1.0, *,
                   return_entropy: Literal[True], chunk_size: int | None = None,
                   packed_mask: str = "auto", fused: bool = True, model_kwargs: dict[str, Any] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                   return_entropy: bool = False, chunk_size: int | None = None,
                   packed_mask: str = "auto", fused: bool = True, model_kwargs: dict[str, Any] | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                   return_entropy: bool = False, chunk_size: int | None = None,
                   packed_mask: str = "auto", fused: bool = True, model_kwargs: dict[str, Any] | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `[B, L]` (fp32) of `input_ids` under `model` with logits divided by `temperature`.

    Args:
        input_ids: `[B, L]` padded, or `[1, T]` packed.
        attention_mask: `[B, L]` 1 on real tokens (padded layout); None for packed rows.
        position_ids: `[B, L]`; for packed rows, restarting at 0 at each sample.
        return_entropy: also return the entropy `[B, L]` of each predicting distribution.
        chunk_size: rows per fp32 chunk (default: 256 MB of fp32 logits per chunk).
        packed_mask: how packed samples are kept apart (module docstring).
        fused: project the hidden states through `lm_head` chunk by chunk inside the log-prob
            kernel (`fused_logprobs.py`: no full-vocabulary logits) when the model allows it.
        model_kwargs: further model inputs (a VLM's `pixel_values`, `image_grid_thw`).
    Returns:
        logprobs, or (logprobs, entropy); 0 at sample starts and padding.
    """
    cp = getattr(model, CONTEXT_PARALLEL_ATTR, None)
    if cp is not None and model_kwargs:
        raise ValueError("context parallelism (--ring_attn_size) does not take pictures (vision-language inputs)")
    if cp is not None:  # split over the ring, shifted on the full sequence, gathered back (parallel/context_parallel.py)
        return cp.token_logprobs(model, input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 temperature=temperature, return_entropy=return_entropy, chunk_size=chunk_size,
                                 fused=fused)
    head = fusable_head(model) if fused else None
    if head is not None:
        with head_bypassed(model) as tap:
            hidden = forward_logits(model, input_ids, attention_mask, position_ids, packed_mask,
                                    model_kwargs=model_kwargs)
        hidden = hidden.to(tap.dtype or hidden.dtype)
        lp, ent = fused_shifted_logprobs(hidden, head.weight, input_ids, temperature, return_entropy, chunk_size)
    else:
        logits = forward_logits(model, input_ids, attention_mask, position_ids, packed_mask, gather=False,
                                model_kwargs=model_kwargs)
        sharded = vocab_sharded(logits)
        if sharded is not None:  # tensor parallel: log-softmax over the vocabulary shards (vocab_parallel.py)
            local, offset, group = sharded
            lp, ent = vocab_parallel_logprobs(local, input_ids, offset, group, temperature, return_entropy, chunk_size)
        else:
            if hasattr(logits, "full_tensor"):
                logits = logits.full_tensor()
            lp, ent = logprobs_from_logits(logits, input_ids, temperature, return_entropy, chunk_size)
    keep = _predicted_positions(input_ids, attention_mask, position_ids)
    lp = torch.where(keep, lp, 0.0)
    if not return_entropy:
        return lp
    assert ent is not None
    return lp, torch.where(keep, ent, 0.0)


def _predicted_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                         position_ids: torch.Tensor | None) -> torch.Tensor:
    """`[B, L]` True where a token has a predecessor in its own sample."""
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    keep[:, 0] = False
    if attention_mask is not None:
        mask = attention_mask.bool()
        first = mask & (mask.long().cumsum(-1) == 1)  # first real token of each row
        keep &= mask & ~first
    elif position_ids is not None:
        seg = segment_ids(position_ids.expand_as(input_ids))
        keep[:, 1:] &= seg[:, 1:] == seg[:, :-1]
    return keep
