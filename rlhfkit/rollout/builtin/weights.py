"""Model description and weights of the builtin engine, read from a Hugging Face decoder-only model.

Supported families (`config.model_type`): llama, qwen2, qwen3, mistral, and the language models of
the vision-language qwen2_vl, qwen2_5_vl (a qwen2 block) and qwen3_vl (a qwen3 block), whose vision
tower lives in vision.py. They share one block:

    x -> RMSNorm -> q,k,v projections (optional bias; Qwen3: RMSNorm on each head of q and k)
      -> RoPE -> attention (grouped-query) -> o projection -> + x
      -> RMSNorm -> down(silu(gate(h)) * up(h)) -> + x

The engine keeps its own copy of the weights, with q/k/v fused into one matrix and gate/up into
another (two GEMMs fewer per layer and step). `WeightNames` maps every Hugging Face parameter name
to a view of a fused tensor, so loading and `update_weights` are one code path: `copy_` into that
view, in place. The tensors never move while the engine is awake, so CUDA graphs captured over
them stay valid after a weight update.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", arXiv 1909.08053): `ModelSpec.shard(rank,
size, group)` is the spec of one of `size` shards. A shard holds its own query heads (and the KV
heads they read; with fewer KV heads than shards each KV head is replicated on size / kv ranks),
its slice of the MLP's intermediate dimension (gate/up rows, down columns), the o projection's
columns for its heads, and its rows of the lm_head (vocab-parallel, ceil(V / size) rows, the last
shard zero-padded); embedding, norms and biases of o / down are replicated. Loading and weight
updates take *full* HF tensors and copy each shard's slice (`targets`: destination view + source
index), so every sender stays shard-agnostic; `load_from_safetensors` reads only a shard's slices
from the files (a 32B model never sits whole in host memory).

RoPE follows Su et al. 2021 ("RoFormer", arXiv 2104.09864) in Hugging Face's rotate-half layout;
frequencies for scaled variants (linear, llama3, yarn) come from transformers' own
`ROPE_INIT_FUNCTIONS`, so they match the reference model exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from rlhfkit.models.vlm import is_vision_name

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # their language model (`text_config`) is the decoder here
QK_NORM_TYPES = ("qwen3", "qwen3_vl")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ShardInfo:
    """Which tensor-parallel shard a spec describes; `group` names the process group (functional
    collectives take the name). `full_*` are the unsharded sizes the HF tensors have."""

    rank: int = 0
    size: int = 1
    group: str | None = None
    full_heads: int = 0
    full_kv_heads: int = 0
    full_intermediate: int = 0

    @property
    def active(self) -> bool:
        return self.size > 1


@dataclass
class ModelSpec:
    """Shapes and constants of one decoder-only model (of one tensor-parallel shard when `tp.active`:
    num_heads, num_kv_heads and intermediate_size are then the shard's own; vocab_size stays the full one)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None = None
    tp: ShardInfo = field(default_factory=ShardInfo)

    @property
    def vocab_rows(self) -> int:
        """Rows of this shard's lm_head: ceil(V / tp size)."""
        return -(-self.vocab_size // self.tp.size)

    def shard(self, rank: int, size: int, group: str | None) -> "ModelSpec":
        """The spec of tensor-parallel shard `rank` of `size` (errors name the sizes that do not divide)."""
        if self.tp.active:
            raise ValueError("ModelSpec.shard: this spec is already a shard")
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} of size {size} is invalid")
        if self.num_heads % size:
            raise ValueError(f"--vllm_tensor_parallel_size {size} must divide the model's {self.num_heads} "
                             "attention heads")
        kv = self.num_kv_heads
        if (kv >= size and kv % size) or (kv < size and size % kv):
            raise ValueError(f"--vllm_tensor_parallel_size {size} and the model's {kv} KV heads: one must "
                             "divide the other")
        if self.intermediate_size % size:
            raise ValueError(f"--vllm_tensor_parallel_size {size} must divide the MLP's intermediate size "
                             f"{self.intermediate_size}")
        info = ShardInfo(rank, size, group, self.num_heads, kv, self.intermediate_size)
        return replace(self, num_heads=self.num_heads // size, num_kv_heads=max(1, kv // size),
                       intermediate_size=self.intermediate_size // size, tp=info)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        model_type = getattr(config, "model_type", "")
        if model_type in VLM_MODEL_TYPES:
            tie = getattr(config, "tie_word_embeddings", None)
            config = config.text_config
            if tie is not None and not getattr(config, "tie_word_embeddings", False):
                config.tie_word_embeddings = tie
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the builtin rollout engine supports model_type {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
                "use --rollout_engine hf or vllm for this model")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"the builtin rollout engine needs hidden_act='silu', the config has {act!r}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            qk_norm=model_type in QK_NORM_TYPES,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=_active_sliding_window(config),
        )


def _active_sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def rope_tables(config, spec: ModelSpec, max_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables `[max_len, head_dim]`, computed in fp32 as Hugging Face does, then cast."""
    inv_freq, scaling = rope_inv_freq(config, spec)
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def rope_inv_freq(config, spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies `[head_dim / 2]` (fp32, host) and the cos / sin scaling; a
    VLM's language model (its `text_config`) rotates text with the same frequencies."""
    if getattr(config, "model_type", "") in VLM_MODEL_TYPES:
        config = config.text_config
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers < 5 style config
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported by the builtin engine "
                         f"(supported: {STATIC_ROPE_TYPES}); use --rollout_engine hf or vllm")
    if rope_type == "default":
        d = spec.head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        inv_freq = inv_freq.float().cpu()
    return inv_freq, float(scaling)


@dataclass
class LayerWeights:
    """One decoder layer; fused `qkv` is `[q_size + 2 kv_size, hidden]`, `gate_up` is `[2 I, hidden]`."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


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
            for k, v in layer.__dict__.items():
                if v is not None:
                    out[f"{i}.{k}"] = v
        return out

    def replace_tensors(self, new: dict[str, torch.Tensor]) -> None:
        tied = self.lm_head is self.embed
        self.embed, self.final_norm = new["embed"], new["final_norm"]
        self.lm_head = self.embed if tied else new["lm_head"]
        for i, layer in enumerate(self.layers):
            for k in list(layer.__dict__):
                if layer.__dict__[k] is not None:
                    setattr(layer, k, new[f"{i}.{k}"])


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_PARTS = {  # HF suffix -> (fused attribute, part index among the fused pieces, how a shard slices it)
    "self_attn.q_proj.weight": ("qkv", 0, "q"), "self_attn.k_proj.weight": ("qkv", 1, "kv"),
    "self_attn.v_proj.weight": ("qkv", 2, "kv"), "self_attn.q_proj.bias": ("qkv_bias", 0, "q"),
    "self_attn.k_proj.bias": ("qkv_bias", 1, "kv"), "self_attn.v_proj.bias": ("qkv_bias", 2, "kv"),
    "self_attn.o_proj.weight": ("o", None, "q_in"), "self_attn.o_proj.bias": ("o_bias", None, None),
    "self_attn.q_norm.weight": ("q_norm", None, None), "self_attn.k_norm.weight": ("k_norm", None, None),
    "mlp.gate_proj.weight": ("gate_up", 0, "i"), "mlp.up_proj.weight": ("gate_up", 1, "i"),
    "mlp.gate_proj.bias": ("gate_up_bias", 0, "i"), "mlp.up_proj.bias": ("gate_up_bias", 1, "i"),
    "mlp.down_proj.weight": ("down", None, "i_in"), "mlp.down_proj.bias": ("down_bias", None, None),
    "input_layernorm.weight": ("input_norm", None, None),
    "post_attention_layernorm.weight": ("post_norm", None, None),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")
_ALL = (slice(None),)

Target = tuple[torch.Tensor, tuple]  # (destination tensor or view, index into the full HF tensor)


def _part_bounds(spec: ModelSpec, attr: str, part: int) -> tuple[int, int]:
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
        return _ALL
    d = spec.head_dim
    if how in ("q", "q_in"):
        rows = slice(t.rank * spec.q_size, (t.rank + 1) * spec.q_size)
    elif how == "kv":
        first = t.rank * t.full_kv_heads // t.size
        rows = slice(first * d, (first + spec.num_kv_heads) * d)
    else:  # "i", "i_in"
        rows = slice(t.rank * spec.intermediate_size, (t.rank + 1) * spec.intermediate_size)
    return (slice(None), rows) if how.endswith("_in") else (rows,)


def _vocab_target(spec: ModelSpec, lm_head: torch.Tensor) -> Target:
    """This shard's rows of the lm_head: (its filled rows, their index in the full matrix); the
    last shard's padding rows beyond the vocabulary stay zero."""
    n = spec.vocab_rows
    rows = slice(spec.tp.rank * n, min((spec.tp.rank + 1) * n, spec.vocab_size))
    return lm_head[:rows.stop - rows.start], (rows,)


def _lm_head_is_embed_view(spec: ModelSpec) -> bool:
    """Tied embeddings and a vocabulary that the shards split evenly: the lm_head shard is a view of `embed`."""
    return spec.tie_word_embeddings and spec.vocab_rows * spec.tp.size == spec.vocab_size


def targets(weights: ModelWeights, spec: ModelSpec, name: str) -> list[Target]:
    """Where HF parameter `name` goes: `(engine tensor or view of a fused tensor, index of the full
    HF tensor that lands there)` pairs (a shard takes its slice; tied embeddings can have two).

    Empty for buffers the engine recomputes (rotary inv_freq); raises KeyError for names that
    belong to no weight of this model.
    """
    if name.startswith("module."):
        name = name[len("module."):]
    if name.startswith("model.language_model."):  # a VLM's language model (transformers 5 module names)
        name = "model." + name[len("model.language_model."):]
    if name.endswith(_IGNORED_SUFFIXES) or (spec.model_type in VLM_MODEL_TYPES and is_vision_name(name)):
        return []  # the rotary buffers are recomputed; a VLM's vision tower is loaded by vision.py
    if name == "model.embed_tokens.weight":
        out = [(weights.embed, _ALL)]
        if spec.tie_word_embeddings and weights.lm_head is not weights.embed and not _lm_head_is_embed_view(spec):
            out.append(_vocab_target(spec, weights.lm_head))  # a padded copy of the embedding's rows
        return out
    if name == "model.norm.weight":
        return [(weights.final_norm, _ALL)]
    if name == "lm_head.weight":
        if spec.tie_word_embeddings and spec.tp.active:
            return targets(weights, spec, "model.embed_tokens.weight")
        return [_vocab_target(spec, weights.lm_head) if spec.tp.active else (weights.lm_head, _ALL)]
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in _LAYER_PARTS or int(m.group(1)) >= len(weights.layers):
        raise KeyError(f"weight {name!r} has no place in the builtin engine's {spec.model_type} model")
    attr, part, how = _LAYER_PARTS[m.group(2)]
    tensor = getattr(weights.layers[int(m.group(1))], attr)
    if tensor is None:
        raise KeyError(f"weight {name!r}: the engine's model was built without {attr} "
                       "(the config and the weights disagree)")
    src = _source_index(spec, how)
    if part is None:
        return [(tensor, src)]
    start, end = _part_bounds(spec, attr, part)
    return [(tensor[start:end], src)]


def normalized_name(name: str) -> str:
    """An HF name as `targets` reads it (no `module.` prefix; a VLM's `model.language_model.` -> `model.`)."""
    name = name.removeprefix("module.")
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def target_view(weights: ModelWeights, spec: ModelSpec, name: str) -> torch.Tensor | None:
    """The engine tensor (or view of a fused tensor) that HF parameter `name` is copied into
    (unsharded engines); None for buffers the engine recomputes."""
    found = targets(weights, spec, name)
    return found[0][0] if found else None


def _copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) == tuple(src.shape):
        dst.copy_(src)
    else:
        raise ValueError(f"weight {name!r}: shape {tuple(src.shape)} does not match the engine's "
                         f"{tuple(dst.shape)}")


def copy_named_tensors(weights: ModelWeights, spec: ModelSpec,
                       named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each full `(hf_name, tensor)` (a shard: its slice) into the engine's weights in place;
    returns the names copied."""
    done: set[str] = set()
    for name, tensor in named_tensors:
        found = targets(weights, spec, name)
        for dst, index in found:
            _copy_into(dst, tensor.detach()[index], name)
        if found:
            done.add(normalized_name(name))
    return done


def _has_bias(names: set[str], suffix: str) -> bool:
    return any(n.endswith(suffix) for n in names)


def allocate_weights(spec: ModelSpec, names: set[str], dtype: torch.dtype,
                     device: torch.device) -> ModelWeights:
    """Empty engine tensors shaped for `spec` (a shard's: its heads, intermediate slice and vocab
    rows); optional biases exist when `names` holds them."""
    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    if spec.model_type in VLM_MODEL_TYPES:  # the vision tower's biases say nothing about the decoder's
        names = {n for n in names if not is_vision_name(n.removeprefix("module."))}

    h, i, qkv_rows = spec.hidden_size, spec.intermediate_size, spec.q_size + 2 * spec.kv_size
    layers = []
    for _ in range(spec.num_layers):
        layers.append(LayerWeights(
            input_norm=empty(h), qkv=empty(qkv_rows, h), o=empty(h, spec.q_size), post_norm=empty(h),
            gate_up=empty(2 * i, h), down=empty(h, i),
            qkv_bias=empty(qkv_rows) if _has_bias(names, "q_proj.bias") else None,
            o_bias=empty(h) if _has_bias(names, "o_proj.bias") else None,
            gate_up_bias=empty(2 * i) if _has_bias(names, "gate_proj.bias") else None,
            down_bias=empty(h) if _has_bias(names, "down_proj.bias") else None,
            q_norm=empty(spec.head_dim) if spec.qk_norm else None,
            k_norm=empty(spec.head_dim) if spec.qk_norm else None,
        ))
    embed = empty(spec.vocab_size, h)
    if not spec.tp.active:
        lm_head = embed if spec.tie_word_embeddings else empty(spec.vocab_size, h)
    elif _lm_head_is_embed_view(spec):
        lm_head = embed[spec.tp.rank * spec.vocab_rows:(spec.tp.rank + 1) * spec.vocab_rows]
    else:
        lm_head = torch.zeros(spec.vocab_rows, h, dtype=dtype, device=device)  # padding rows: logit 0, cut
    return ModelWeights(embed=embed, final_norm=empty(h), lm_head=lm_head, layers=layers)


def _check_loaded(spec: ModelSpec, loaded: set[str]) -> None:
    needed = {"model.embed_tokens.weight", "model.norm.weight"}
    if not spec.tie_word_embeddings:
        needed.add("lm_head.weight")
    missing = sorted(needed - loaded)
    if missing:
        raise ValueError(f"the model's state dict lacks {missing}")
    expected_per_layer = 9 + (2 if spec.qk_norm else 0)
    counts = [0] * spec.num_layers
    for k in loaded:
        m = _LAYER_RE.match(k)
        if m is not None and "bias" not in k:
            counts[int(m.group(1))] += 1
    for li, n in enumerate(counts):
        if n != expected_per_layer:
            raise ValueError(f"layer {li}: found {n} weight matrices/norms, expected {expected_per_layer}")


def _shard_spec(config, shard: tuple[int, int, str | None] | None) -> ModelSpec:
    spec = ModelSpec.from_hf_config(config)
    return spec.shard(*shard) if shard is not None and shard[1] > 1 else spec


def load_from_hf_model(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                       shard: tuple[int, int, str | None] | None = None) -> tuple[ModelSpec, ModelWeights]:
    """Build the engine's spec and weights from an HF `*ForCausalLM` module (the module is not kept).
    `shard`: (rank, size, group name) of a tensor-parallel engine."""
    spec = _shard_spec(model.config, shard)
    state = model.state_dict()
    weights = allocate_weights(spec, set(state), dtype, device)
    _check_loaded(spec, copy_named_tensors(weights, spec, state.items()))
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

    spec = _shard_spec(config, shard)
    files = safetensors_files(path)
    names: set[str] = set()
    for fname in files:
        with safe_open(fname, framework="pt") as f:
            names.update(f.keys())
    weights = allocate_weights(spec, names, dtype, device)
    loaded: set[str] = set()
    for fname in files:
        with safe_open(fname, framework="pt") as f:
            for name in f.keys():
                found = targets(weights, spec, name)
                for dst, index in found:
                    piece = f.get_slice(name)[index] if index != _ALL else f.get_tensor(name)
                    _copy_into(dst, piece.to(dtype), name)
                if found:
                    loaded.add(normalized_name(name))
    if spec.tie_word_embeddings and "lm_head.weight" in loaded:
        loaded.add("model.embed_tokens.weight")
    _check_loaded(spec, loaded)
    return spec, weights
