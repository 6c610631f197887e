"""The builtin engine's weights, read from a Hugging Face decoder-only model (the model's description: spec.py).

The engine's weights have q/k/v fused into one matrix and gate/up into another (two GEMMs fewer per
layer and step), and each MoE layer's experts as two `[E, out, in]` tensors for grouped GEMMs; they are
a copy of their own, or the training module's parameters themselves (model/shared_weights.py; a 4-bit
base is dequantized a layer at a time: model/quantized.py). `targets` maps every Hugging Face parameter name to a view of an engine
tensor, so loading and `update_weights` are one code path: `copy_` into that view, in place. The
tensors never move while the engine is awake, so CUDA graphs captured over them stay valid after a
weight update.

Tensor parallelism (spec.py): loading and weight updates take *full* HF tensors and copy each shard's slice
(`targets`: destination view + source index), so every sender stays shard-agnostic; `load_from_safetensors`
reads only a shard's slices from the files (a 32B model never sits whole in host memory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from rlhfkit.models.vlm import is_vision_name
from rlhfkit.rollout.builtin.model.families import EXPERT_RE, LayerKind
from rlhfkit.rollout.builtin.model.quantized import QuantPart
from rlhfkit.rollout.builtin.model.spec import VLM_MODEL_TYPES, ModelSpec, shard_spec

_LAYER_TENSORS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "sinks", "attn_out_norm",
                  "mlp_norm", "gate_up", "gate_up_bias", "down", "down_bias", "router", "router_bias",
                  "experts_gate_up", "experts_gate_up_bias", "experts_down", "experts_down_bias", "mlp_out_norm")


@dataclass
class LoraPart:
    """A LoRA adapter on rows `start:end` of a fused engine tensor (q, k or v of `qkv`; gate or up of
    `gate_up`; all of `o` or `down`): the layer's output there gains `scale * (x @ a.T) @ b.T`. `a [r, in]`
    and `b [end - start, r]` are the trainer's own adapter tensors (detached views), which the tensor's
    `LoraPack` copies from at each weight update."""

    start: int
    end: int
    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class LoraPack:
    """The unmerged LoRA adapters on one engine tensor, packed so that they cost two GEMMs for the whole
    tensor whatever its parts (q, k and v of `qkv` share one input): `a [R, in]` stacks the parts' A (R: their
    ranks summed) and `b [out, R]` holds each part's B x scale on its rows and its rank's columns, zero
    elsewhere; the output gains (x @ a.T) @ b.T. `a` and `b` are the engine's: `refresh()` copies the parts
    (the trainer's tensors) into them in place, so captured graphs stay valid; a weight update calls it."""

    parts: list[LoraPart]
    a: torch.Tensor
    b: torch.Tensor

    @classmethod
    def of(cls, parts: list[LoraPart], out_features: int) -> "LoraPack":
        a0 = parts[0].a
        rank = sum(p.a.shape[0] for p in parts)
        pack = cls(parts, torch.empty(rank, a0.shape[1], dtype=a0.dtype, device=a0.device),
                   torch.zeros(out_features, rank, dtype=a0.dtype, device=a0.device))
        pack.refresh()
        return pack

    @torch.no_grad()
    def refresh(self) -> None:
        col = 0
        for p in self.parts:
            r = p.a.shape[0]
            self.a[col:col + r].copy_(p.a)
            self.b[p.start:p.end, col:col + r].copy_(p.b).mul_(p.scale)
            col += r

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the engine tensor's output for input `x`) with the adapters' output added in place."""
        xa = torch.nn.functional.linear(x, self.a)
        y.view(-1, y.shape[-1]).addmm_(xa.view(-1, xa.shape[-1]), self.b.t())
        return y


@dataclass
class LayerWeights:
    """One decoder layer (model/families.py says which tensors a family has).

    Fused `qkv` is `[q_size + 2 kv_size, hidden]` and `gate_up` `[2 I, hidden]`; routed experts
    are `experts_gate_up [E, 2 I_e, hidden]` (gpt-oss: gate and up rows interleaved) and
    `experts_down [E, hidden, I_e]`, with the router `[E, hidden]`. `kind` is the layer's
    `LayerKind` (window, rope table, experts)."""

    qkv: torch.Tensor
    o: torch.Tensor
    input_norm: torch.Tensor | None = None
    mlp_norm: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    router: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_gate_up_bias: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    experts_down_bias: torch.Tensor | None = None
    kind: LayerKind = field(default_factory=LayerKind)
    # unmerged LoRA adapters by engine tensor ("qkv", "o", "gate_up", "down"): an engine sharing a LoRA
    # policy's weights (shared_weights.adopt_parameters); not in named_tensors (no HF name loads into them)
    lora: dict[str, LoraPack] = field(default_factory=dict)
    # 4-bit weights by engine tensor (an engine sharing a QLoRA policy's base: model/quantized.py); each such
    # tensor is a scratch that every layer shares and `quantized.dequantize_layer` fills before the layer runs
    quant: dict[str, list[QuantPart]] = field(default_factory=dict)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in _LAYER_TENSORS if getattr(self, k) is not None}


@dataclass
class ModelWeights:
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor as `embed` when embeddings are tied
    layers: list[LayerWeights] = field(default_factory=list)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every distinct tensor by a stable internal key (used to move weights between devices)."""
        out = {"embed": self.embed, "final_norm": self.final_norm}
        if self.lm_head is not self.embed:
            out["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            for k, v in layer.named_tensors().items():
                out[f"{i}.{k}"] = v
            for k, pack in layer.lora.items():
                out[f"{i}.lora.{k}.a"], out[f"{i}.lora.{k}.b"] = pack.a, pack.b
        return out

    def refresh_lora(self) -> None:
        """Copy the trainer's LoRA adapters into the packs the engine applies (after a weight update)."""
        for layer in self.layers:
            for pack in layer.lora.values():
                pack.refresh()

    def replace_tensors(self, new: dict[str, torch.Tensor]) -> None:
        tied = self.lm_head is self.embed
        self.embed, self.final_norm = new["embed"], new["final_norm"]
        self.lm_head = self.embed if tied else new["lm_head"]
        for i, layer in enumerate(self.layers):
            for k in layer.named_tensors():
                setattr(layer, k, new[f"{i}.{k}"])
            for k, pack in layer.lora.items():
                pack.a, pack.b = new[f"{i}.lora.{k}.a"], new[f"{i}.lora.{k}.b"]


LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")
ALL_ROWS = (slice(None),)  # the index of a whole tensor

Target = tuple[torch.Tensor, tuple]  # (destination tensor or view, index into the full HF tensor)


def part_bounds(spec: ModelSpec, attr: str, part: int) -> tuple[int, int]:
    if attr.startswith("qkv"):
        sizes = [spec.q_size, spec.kv_size, spec.kv_size]
    else:
        sizes = [spec.intermediate_size, spec.intermediate_size]
    start = sum(sizes[:part])
    return start, start + sizes[part]


def _source_index(spec: ModelSpec, how: str | None) -> tuple:
    """The index of a shard's piece of a full HF tensor (`how`: which dimension is split)."""
    t = spec.tp
    if not t.active or how is None:
        return ALL_ROWS
    d = spec.head_dim
    if how in ("q", "q_in"):
        rows = slice(t.rank * spec.q_size, (t.rank + 1) * spec.q_size)
    elif how == "kv":
        first = t.rank * t.full_kv_heads // t.size
        rows = slice(first * d, (first + spec.num_kv_heads) * d)
    elif how == "heads":
        rows = slice(t.rank * spec.num_heads, (t.rank + 1) * spec.num_heads)
    else:  # "i", "i_in"
        rows = slice(t.rank * spec.intermediate_size, (t.rank + 1) * spec.intermediate_size)
    return (slice(None), rows) if how.endswith("_in") else (rows,)


def _fused_pieces(spec: ModelSpec, tensor: torch.Tensor, how: str) -> list[Target]:
    """Targets of one HF tensor that holds every piece of a fused engine tensor (Phi-3's
    `qkv_proj` = [q; k; v], `gate_up_proj` = [gate; up]): each piece's rows, shifted to where the
    piece starts in the full HF tensor."""
    t = spec.tp
    if how == "qkv":
        full_q = (t.full_heads if t.active else spec.num_heads) * spec.head_dim
        full_kv = (t.full_kv_heads if t.active else spec.num_kv_heads) * spec.head_dim
        pieces = [("q", 0), ("kv", full_q), ("kv", full_q + full_kv)]
    else:
        full_i = t.full_intermediate if t.active else spec.intermediate_size
        pieces = [("i", 0), ("i", full_i)]
    out = []
    for part, (piece_how, offset) in enumerate(pieces):
        start, end = part_bounds(spec, "qkv" if how == "qkv" else "gate_up", part)
        rows = _source_index(spec, piece_how)[0] if t.active else slice(0, end - start)
        out.append((tensor[start:end], (slice(rows.start + offset, rows.stop + offset),)))
    return out


def _vocab_target(spec: ModelSpec, lm_head: torch.Tensor) -> Target:
    """This shard's rows of the lm_head: (its filled rows, their index in the full matrix); the
    last shard's padding rows beyond the vocabulary stay zero."""
    n = spec.vocab_rows
    rows = slice(spec.tp.rank * n, min((spec.tp.rank + 1) * n, spec.vocab_size))
    return lm_head[:rows.stop - rows.start], (rows,)


def _lm_head_is_embed_view(spec: ModelSpec) -> bool:
    """Tied embeddings and a vocabulary that the shards split evenly: the lm_head shard is a view of `embed`."""
    return spec.tie_word_embeddings and spec.vocab_rows * spec.tp.size == spec.vocab_size


def normalized_name(name: str) -> str:
    """An HF name as `targets` reads it (no `module.` prefix; a VLM's `model.language_model.` -> `model.`)."""
    name = name.removeprefix("module.")
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def targets(weights: ModelWeights, spec: ModelSpec, name: str) -> list[Target]:
    """Where HF parameter `name` goes: `(engine tensor or view of a fused tensor, index of the full
    HF tensor that lands there)` pairs (a shard takes its slice; tied embeddings can have two).

    Empty for buffers the engine recomputes (rotary inv_freq); raises KeyError for names that
    belong to no weight of this model.
    """
    return [(dst, index) for dst, index, _ in keyed_targets(weights, spec, name)]


def keyed_targets(weights: ModelWeights, spec: ModelSpec, name: str) -> list[tuple[torch.Tensor, tuple, str]]:
    """`targets`, each with the key of the engine tensor it fills ("embed", "3.qkv", ...)."""
    name = normalized_name(name)
    if name.endswith(_IGNORED_SUFFIXES) or (spec.model_type in VLM_MODEL_TYPES and is_vision_name(name)):
        return []  # the rotary buffers are recomputed; a VLM's vision tower is loaded by model/vision.py
    if name == "model.embed_tokens.weight":
        out = [(weights.embed, ALL_ROWS, "embed")]
        if spec.tie_word_embeddings and weights.lm_head is not weights.embed and not _lm_head_is_embed_view(spec):
            out.append((*_vocab_target(spec, weights.lm_head), "lm_head"))  # a padded copy of the embedding's rows
        return out
    if name == "model.norm.weight":
        return [(weights.final_norm, ALL_ROWS, "final_norm")]
    if name == "lm_head.weight":
        if spec.tie_word_embeddings and spec.tp.active:
            return keyed_targets(weights, spec, "model.embed_tokens.weight")
        return [(*(_vocab_target(spec, weights.lm_head) if spec.tp.active else (weights.lm_head, ALL_ROWS)), "lm_head")]
    m = LAYER_RE.match(name)
    if m is None or int(m.group(1)) >= len(weights.layers):
        raise KeyError(f"weight {name!r} has no place in the builtin engine's {spec.model_type} model")
    li, suffix = int(m.group(1)), m.group(2)
    layer = weights.layers[li]
    expert = EXPERT_RE.match(suffix)
    if expert is not None:
        return [(dst, index, f"{li}.{attr}") for dst, index, attr in _expert_target(layer, spec, name, expert)]
    entry = spec.family.names.get(suffix)
    if entry is None:
        raise KeyError(f"weight {name!r} has no place in the builtin engine's {spec.model_type} model")
    attr, part, how = entry
    tensor = getattr(layer, attr)
    if tensor is None:
        raise KeyError(f"weight {name!r}: the engine's model was built without {attr} "
                       "(the config and the weights disagree)")
    key = f"{li}.{attr}"
    if part == "T":  # the HF tensor is the engine's transposed: copy into a transposed view
        return [(tensor.transpose(-1, -2), ALL_ROWS, key)]
    if part == "all":
        assert how is not None  # a fused tensor's rule says how its pieces split (model/families.py)
        return [(dst, index, key) for dst, index in _fused_pieces(spec, tensor, how)]
    src = _source_index(spec, how)
    if part is None:
        return [(tensor, src, key)]
    start, end = part_bounds(spec, attr, part)
    return [(tensor[start:end], src, key)]


def _expert_target(layer: LayerWeights, spec: ModelSpec, name: str,
                   match: re.Match) -> list[tuple[torch.Tensor, tuple, str]]:
    """One expert's gate / up / down matrix of a checkpoint on disk -> its rows of the fused tensors."""
    e, which = int(match.group(1)), match.group(2)
    attr = "experts_down" if which == "down" else "experts_gate_up"
    tensor = getattr(layer, attr)
    if tensor is None or spec.moe is None or e >= tensor.shape[0]:
        raise KeyError(f"weight {name!r} has no place in the builtin engine's {spec.model_type} model")
    if which == "down":
        return [(tensor[e], ALL_ROWS, attr)]
    i = spec.moe.intermediate_size
    part = 0 if which == "gate" else 1
    return [(tensor[e, part * i:(part + 1) * i], ALL_ROWS, attr)]


def target_view(weights: ModelWeights, spec: ModelSpec, name: str) -> torch.Tensor | None:
    """The engine tensor (or view of a fused tensor) that HF parameter `name` is copied into
    (unsharded engines); None for buffers the engine recomputes."""
    found = targets(weights, spec, name)
    return found[0][0] if found else None


def copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) == tuple(src.shape):
        dst.copy_(src)
    else:
        raise ValueError(f"weight {name!r}: shape {tuple(src.shape)} does not match the engine's "
                         f"{tuple(dst.shape)}")


class Coverage:
    """How many values of each engine tensor a load has filled (every one must be filled once)."""

    def __init__(self) -> None:
        self.filled: dict[str, int] = {}
        self.names: set[str] = set()

    def add(self, name: str, found: list[tuple[torch.Tensor, tuple, str]]) -> None:
        for dst, _, key in found:
            self.filled[key] = self.filled.get(key, 0) + dst.numel()
        if found:
            self.names.add(normalized_name(name))

    def check(self, spec: ModelSpec, weights: ModelWeights) -> None:
        needed = {"model.embed_tokens.weight", "model.norm.weight"}
        if not spec.tie_word_embeddings:
            needed.add("lm_head.weight")
        names = set(self.names)
        if spec.tie_word_embeddings and "lm_head.weight" in names:
            names.add("model.embed_tokens.weight")
        missing = sorted(needed - names)
        if missing:
            raise ValueError(f"the model's state dict lacks {missing}")
        for li, layer in enumerate(weights.layers):
            for attr, tensor in layer.named_tensors().items():
                got = self.filled.get(f"{li}.{attr}", 0)
                if got != tensor.numel():
                    raise ValueError(f"layer {li}: the weights filled {got} of the {tensor.numel()} values of "
                                     f"the engine's {attr} (the checkpoint lacks weights or holds some twice)")


def copy_named_tensors(weights: ModelWeights, spec: ModelSpec,
                       named_tensors: Iterable[tuple[str, torch.Tensor]], coverage: Coverage | None = None) -> set[str]:
    """Copy each full `(hf_name, tensor)` (a shard: its slice) into the engine's weights in place;
    returns the names copied."""
    done: set[str] = set()
    for name, tensor in named_tensors:
        found = keyed_targets(weights, spec, name)
        for dst, index, _ in found:
            copy_into(dst, tensor.detach()[index], name)
        if found:
            done.add(normalized_name(name))
        if coverage is not None:
            coverage.add(name, found)
    return done


def _has_bias(names: set[str], suffix: str) -> bool:
    return any(n.endswith(suffix) for n in names)


def allocate_weights(spec: ModelSpec, names: set[str], dtype: torch.dtype,
                     device: torch.device) -> ModelWeights:
    """Empty engine tensors shaped for `spec` (a shard's: its heads, intermediate slice and vocab
    rows); optional biases exist when `names` holds them."""
    def empty(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dt, device=device)

    if spec.model_type in VLM_MODEL_TYPES:  # the vision tower's biases say nothing about the decoder's
        names = {n for n in names if not is_vision_name(n.removeprefix("module."))}
    fam = spec.family
    norm_dt = torch.float32 if fam.fp32_norm_weights else dtype
    h, i, qkv_rows = spec.hidden_size, spec.intermediate_size, spec.q_size + 2 * spec.kv_size

    def norm(on: bool = True) -> torch.Tensor | None:
        return empty(h, dt=norm_dt) if on else None

    qn, kn = ((spec.head_dim, spec.head_dim) if fam.qk_norm == "head" else
              (spec.q_size, spec.kv_size) if fam.qk_norm == "full" else (0, 0))
    layers = []
    for li in range(spec.num_layers):
        kind = spec.kind(li)
        lw = LayerWeights(
            qkv=empty(qkv_rows, h), o=empty(h, spec.q_size), kind=kind,
            input_norm=norm(fam.pre_norms), mlp_norm=norm(fam.pre_norms),
            attn_out_norm=norm(fam.post_norms), mlp_out_norm=norm(fam.post_norms),
            qkv_bias=empty(qkv_rows) if _has_bias(names, "q_proj.bias") else None,
            o_bias=empty(h) if _has_bias(names, "o_proj.bias") else None,
            q_norm=empty(qn, dt=norm_dt) if qn else None, k_norm=empty(kn, dt=norm_dt) if kn else None,
            sinks=empty(spec.num_heads) if fam.sinks else None,
        )
        if kind.moe:
            moe = spec.moe
            assert moe is not None  # a model with routed layers has its MoESpec
            e, ie = moe.num_experts, moe.intermediate_size
            lw.router, lw.experts_gate_up, lw.experts_down = empty(e, h), empty(e, 2 * ie, h), empty(e, h, ie)
            if moe.bias:
                lw.router_bias, lw.experts_gate_up_bias, lw.experts_down_bias = empty(e), empty(e, 2 * ie), empty(e, h)
        else:
            lw.gate_up, lw.down = empty(2 * i, h), empty(h, i)
            lw.gate_up_bias = empty(2 * i) if _has_bias(names, "gate_proj.bias") else None
            lw.down_bias = empty(h) if _has_bias(names, "down_proj.bias") else None
        layers.append(lw)
    embed = empty(spec.vocab_size, h)
    if not spec.tp.active:
        lm_head = embed if spec.tie_word_embeddings else empty(spec.vocab_size, h)
    elif _lm_head_is_embed_view(spec):
        lm_head = embed[spec.tp.rank * spec.vocab_rows:(spec.tp.rank + 1) * spec.vocab_rows]
    else:
        lm_head = torch.zeros(spec.vocab_rows, h, dtype=dtype, device=device)  # padding rows: logit 0, cut
    return ModelWeights(embed=embed, final_norm=empty(h, dt=norm_dt), lm_head=lm_head, layers=layers)


def load_from_hf_model(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                       shard: tuple[int, int, str | None] | None = None) -> tuple[ModelSpec, ModelWeights]:
    """Build the engine's spec and weights from an HF `*ForCausalLM` module (the module is not kept).
    `shard`: (rank, size, group name) of a tensor-parallel engine."""
    spec = shard_spec(model.config, shard)
    state = model.state_dict()
    weights = allocate_weights(spec, set(state), dtype, device)
    coverage = Coverage()
    copy_named_tensors(weights, spec, state.items(), coverage)
    coverage.check(spec, weights)
    return spec, weights


def safetensors_files(path: str) -> list[str]:
    """The weight files of an HF model directory (sharded with an index, or one file)."""
    import json
    import os

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return [single]


def load_from_safetensors(path: str, config, dtype: torch.dtype, device: torch.device,
                          shard: tuple[int, int, str | None] | None = None) -> tuple[ModelSpec, ModelWeights]:
    """Like `load_from_hf_model`, read straight from the directory's safetensors files: one tensor
    at a time, and of each only this shard's slice (`safe_open(...).get_slice`)."""
    from safetensors import safe_open

    spec = shard_spec(config, shard)
    files = safetensors_files(path)
    names: set[str] = set()
    for fname in files:
        with safe_open(fname, framework="pt") as f:
            names.update(f.keys())
    weights = allocate_weights(spec, names, dtype, device)
    coverage = Coverage()
    for fname in files:
        with safe_open(fname, framework="pt") as f:
            for name in f.keys():
                found = keyed_targets(weights, spec, name)
                for dst, index, _ in found:
                    piece = f.get_slice(name)[index] if index != ALL_ROWS else f.get_tensor(name)
                    copy_into(dst, piece.to(dst.dtype), name)
                coverage.add(name, found)
    coverage.check(spec, weights)
    return spec, weights
