"""Model description and weights of the builtin engine, read from a Hugging Face decoder-only model.

Supported families (`config.model_type`, model/families.py): llama, mistral, qwen2, qwen3, phi3, olmo2,
olmo3, gemma3_text, qwen3_moe, gpt_oss, and the language models of the vision-language qwen2_vl,
qwen2_5_vl (a qwen2 block) and qwen3_vl (a qwen3 block), whose vision tower lives in model/vision.py.
model/families.py draws the one block they share and what each family changes in it.

The engine's weights have q/k/v fused into one matrix and gate/up into another (two GEMMs fewer per
layer and step), and each MoE layer's experts as two `[E, out, in]` tensors for grouped GEMMs; they are
a copy of their own, or the training module's parameters themselves (model/shared_weights.py). `targets` maps every Hugging Face parameter name to a view of an engine
tensor, so loading and `update_weights` are one code path: `copy_` into that view, in place. The
tensors never move while the engine is awake, so CUDA graphs captured over them stay valid after a
weight update.

Tensor parallelism (column- and row-parallel projections): `ModelSpec.shard(rank,
size, group)` is the spec of one of `size` shards. A shard holds its own query heads (and the KV
heads they read; with fewer KV heads than shards each KV head is replicated on size / kv ranks),
its slice of the MLP's intermediate dimension (gate/up rows, down columns), the o projection's
columns for its heads, and its rows of the lm_head (vocab-parallel, ceil(V / size) rows, the last
shard zero-padded); embedding, norms and biases of o / down are replicated. Loading and weight
updates take *full* HF tensors and copy each shard's slice (`targets`: destination view + source
index), so every sender stays shard-agnostic; `load_from_safetensors` reads only a shard's slices
from the files (a 32B model never sits whole in host memory). Routed experts and OLMo's q/k norms
over the whole projection are not sharded: such engines run on one device.

Rotary position embeddings in Hugging Face's rotate-half layout;
frequencies for scaled variants (linear, llama3, yarn, longrope within its original length) come
from transformers' own `ROPE_INIT_FUNCTIONS`, so they match the reference model exactly. A family
with one rope per layer type (Gemma 3: local and global layers) gets one table per type; a partial
rotary dimension (Phi-3 variants) is a table whose columns past it are cos 1, sin 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from rlhfkit.models.hf_config import ConfigFields
from rlhfkit.models.vlm import is_vision_name
from rlhfkit.rollout.builtin.model.families import (EXPERT_RE, FAMILIES, SUPPORTED_MODEL_TYPES, Family, LayerKind,
                                                    MoESpec, layer_types, moe_layers, moe_spec)

VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # their language model (`text_config`) is the decoder here
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ROPE_LAYER_TYPES = ("full_attention", "sliding_attention")  # table order of a per-layer-type rope


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


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass
class ModelSpec:
    """Shapes and constants of one decoder-only model (of one tensor-parallel shard when `tp.active`:
    num_heads, num_kv_heads and intermediate_size are then the shard's own; vocab_size stays the full one).

    `layer_kinds` holds each layer's `LayerKind` (window, rope table, experts; empty: every layer
    full attention on table 0 with a dense MLP); `sliding_window` is the largest window of any layer."""

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
    layer_kinds: tuple[LayerKind, ...] = ()
    attn_scale: float | None = None  # None: head_dim ** -0.5
    rotary_dim: int | None = None  # None: the whole head_dim rotates
    moe: MoESpec | None = None
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    activation: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh"

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    def kind(self, layer: int) -> LayerKind:
        return self.layer_kinds[layer] if self.layer_kinds else LayerKind()

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def embed_scale(self) -> float | None:
        return self.hidden_size ** 0.5 if self.family.embed_scale else None

    @property
    def num_rope_tables(self) -> int:
        return 1 + max((k.rope for k in self.layer_kinds), default=0)

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
        if size > 1 and (self.moe is not None or self.family.qk_norm == "full"):
            what = "routed experts" if self.moe is not None else "q/k norms over the whole projection"
            raise ValueError(f"--vllm_tensor_parallel_size {size}: the builtin engine does not shard "
                             f"{self.model_type}'s {what}; run its engines on one GPU each")
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
        model_type = ConfigFields.of(config).model_type
        if model_type in VLM_MODEL_TYPES:
            tie = ConfigFields.of(config).tie_word_embeddings
            config = config.text_config
            if tie is not None and not ConfigFields.of(config).tie_word_embeddings:
                config.tie_word_embeddings = tie
        f = ConfigFields.of(config)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the builtin rollout engine supports model_type {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
                "use --rollout_engine hf or vllm for this model")
        family = FAMILIES[model_type]
        act_name = f.hidden_activation or f.hidden_act
        act = ACTIVATIONS.get(act_name)
        if act is None or (family.router is None and act != family.act):
            raise ValueError(f"the builtin engine runs {model_type} with hidden_act {family.act!r}, the config has "
                             f"{act_name!r}; use --rollout_engine hf or vllm for this model")
        for attr, value in (("attn_logit_softcapping", f.attn_logit_softcapping),
                            ("use_bidirectional_attention", f.use_bidirectional_attention)):
            if value:
                raise ValueError(f"the builtin engine does not implement {attr}={value!r}; "
                                 "use --rollout_engine hf or vllm for this model")
        head_dim = f.head_dim or config.hidden_size // config.num_attention_heads
        kinds = _layer_kinds(config, family)
        windows = [k.window for k in kinds if k.window is not None]
        factor = float(_rope_params(config).get("partial_rotary_factor", f.partial_rotary_factor) or 1.0)
        rotary = int(head_dim * factor)
        pre_attn = f.query_pre_attn_scalar if model_type == "gemma3_text" else None
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=f.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            qk_norm=family.qk_norm is not None,
            tie_word_embeddings=bool(f.tie_word_embeddings),
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=max(windows) if windows else None,
            layer_kinds=tuple(kinds),
            attn_scale=float(pre_attn) ** -0.5 if pre_attn else None,
            rotary_dim=rotary if rotary < head_dim else None,
            moe=moe_spec(config, family),
            final_softcap=f.final_logit_softcapping,
            activation=act,
        )


def _rope_params(config) -> dict:
    """The config's rope parameters (for a per-layer-type rope: the full-attention layers')."""
    params = dict(ConfigFields.of(config).rope_parameters or {})
    if params and set(params) <= set(ROPE_LAYER_TYPES):
        return dict(params.get("full_attention") or {})
    return params


def _per_type_rope(config) -> bool:
    params = ConfigFields.of(config).rope_parameters or {}
    return bool(params) and set(params) <= set(ROPE_LAYER_TYPES)


def _layer_kinds(config, family: Family) -> list[LayerKind]:
    types, moe = layer_types(config), moe_layers(config, family)
    window = ConfigFields.of(config).sliding_window
    per_type = _per_type_rope(config)
    kinds = []
    for t, is_moe in zip(types, moe):
        sliding = t == "sliding_attention" and window is not None
        rope = ROPE_LAYER_TYPES.index(t) if per_type and t in ROPE_LAYER_TYPES else 0
        kinds.append(LayerKind(window=int(window) if sliding and window is not None else None, rope=rope,
                               moe=is_moe))
    if per_type:  # table indices without gaps (a model whose layers are all windowed has one table)
        used = sorted({k.rope for k in kinds})
        kinds = [replace(k, rope=used.index(k.rope)) for k in kinds]
    return kinds


def _table_layer_types(config, spec: ModelSpec) -> list[str | None]:
    """The HF layer type behind each rope table index (None: the config has one rope)."""
    if not _per_type_rope(config):
        return [None]
    used = sorted({ROPE_LAYER_TYPES.index(t) for t in layer_types(config) if t in ROPE_LAYER_TYPES})
    return [ROPE_LAYER_TYPES[i] for i in used]


def rope_table_set(config, spec: ModelSpec, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) tables `[max_len, head_dim]`, one per rope table index of `spec.layer_kinds`,
    computed in fp32 as Hugging Face does, then cast. With a partial rotary dimension R the
    columns from R on are cos 1, sin 0 (those dimensions pass through)."""
    if getattr(config, "model_type", "") in VLM_MODEL_TYPES:
        config = config.text_config
    out = []
    for layer_type in _table_layer_types(config, spec):
        inv_freq, scaling = rope_inv_freq(config, spec, layer_type, max_len)
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        pad = spec.head_dim - cos.shape[1]
        if pad:
            cos = torch.cat([cos, torch.ones(max_len, pad)], dim=1)
            sin = torch.cat([sin, torch.zeros(max_len, pad)], dim=1)
        out.append((cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)))
    return out


def rope_tables(config, spec: ModelSpec, max_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (cos, sin) table of `rope_table_set` (the only one of most models)."""
    return rope_table_set(config, spec, max_len, dtype, device)[0]


def rope_inv_freq(config, spec: ModelSpec, layer_type: str | None = None,
                  max_len: int | None = None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies `[rotary_dim / 2]` (fp32, host) and the cos / sin scaling of
    one layer type (None: the model's one rope); a VLM's language model (its `text_config`) rotates
    text with the same frequencies."""
    if getattr(config, "model_type", "") in VLM_MODEL_TYPES:
        config = config.text_config
    if layer_type is None and _per_type_rope(config):  # one rope per layer type: the full-attention layers'
        layer_type = "full_attention" if "full_attention" in config.rope_parameters else "sliding_attention"
    params = dict(config.rope_parameters[layer_type] or {}) if layer_type is not None else _rope_params(config)
    if not params:  # transformers < 5 style config
        params = dict(ConfigFields.of(config).rope_scaling or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported by the builtin engine "
                         f"(supported: {STATIC_ROPE_TYPES}); use --rollout_engine hf or vllm")
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings",
                              ConfigFields.of(config).original_max_position_embeddings)
        if max_len is not None and original is not None and max_len > original:
            raise ValueError(f"longrope switches to its long factors beyond {original} tokens, which the builtin "
                             f"engine does not do: keep max_model_len (now {max_len}) at most {original}, or use "
                             "--rollout_engine hf or vllm")
    if rope_type == "default":
        d = spec.rotary_dim or spec.head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
        inv_freq = inv_freq.float().cpu()
    return inv_freq, float(scaling)


_LAYER_TENSORS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "sinks", "attn_out_norm",
                  "mlp_norm", "gate_up", "gate_up_bias", "down", "down_bias", "router", "router_bias",
                  "experts_gate_up", "experts_gate_up_bias", "experts_down", "experts_down_bias", "mlp_out_norm")


@dataclass
class LoraPart:
    """A LoRA adapter on rows `start:end` of a fused engine tensor (q, k or v of `qkv`; gate or up of
    `gate_up`; all of `o` or `down`): the layer's output there gains `scale * (x @ a.T) @ b.T`. `a [r, in]`
    and `b [end - start, r]` are the trainer's own adapter tensors (detached views), so an optimizer step is
    served at once."""

    start: int
    end: int
    a: torch.Tensor
    b: torch.Tensor
    scale: float


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
    # policy's weights (shared_weights.adopt_parameters); not in named_tensors (the trainer owns them)
    lora: dict[str, list[LoraPart]] = field(default_factory=dict)

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
        return out

    def replace_tensors(self, new: dict[str, torch.Tensor]) -> None:
        tied = self.lm_head is self.embed
        self.embed, self.final_norm = new["embed"], new["final_norm"]
        self.lm_head = self.embed if tied else new["lm_head"]
        for i, layer in enumerate(self.layers):
            for k in layer.named_tensors():
                setattr(layer, k, new[f"{i}.{k}"])


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
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
        start, end = _part_bounds(spec, "qkv" if how == "qkv" else "gate_up", part)
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
    return [(dst, index) for dst, index, _ in _keyed_targets(weights, spec, name)]


def _keyed_targets(weights: ModelWeights, spec: ModelSpec, name: str) -> list[tuple[torch.Tensor, tuple, str]]:
    """`targets`, each with the key of the engine tensor it fills ("embed", "3.qkv", ...)."""
    name = normalized_name(name)
    if name.endswith(_IGNORED_SUFFIXES) or (spec.model_type in VLM_MODEL_TYPES and is_vision_name(name)):
        return []  # the rotary buffers are recomputed; a VLM's vision tower is loaded by model/vision.py
    if name == "model.embed_tokens.weight":
        out = [(weights.embed, _ALL, "embed")]
        if spec.tie_word_embeddings and weights.lm_head is not weights.embed and not _lm_head_is_embed_view(spec):
            out.append((*_vocab_target(spec, weights.lm_head), "lm_head"))  # a padded copy of the embedding's rows
        return out
    if name == "model.norm.weight":
        return [(weights.final_norm, _ALL, "final_norm")]
    if name == "lm_head.weight":
        if spec.tie_word_embeddings and spec.tp.active:
            return _keyed_targets(weights, spec, "model.embed_tokens.weight")
        return [(*(_vocab_target(spec, weights.lm_head) if spec.tp.active else (weights.lm_head, _ALL)), "lm_head")]
    m = _LAYER_RE.match(name)
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
        return [(tensor.transpose(-1, -2), _ALL, key)]
    if part == "all":
        assert how is not None  # a fused tensor's rule says how its pieces split (model/families.py)
        return [(dst, index, key) for dst, index in _fused_pieces(spec, tensor, how)]
    src = _source_index(spec, how)
    if part is None:
        return [(tensor, src, key)]
    start, end = _part_bounds(spec, attr, part)
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
        return [(tensor[e], _ALL, attr)]
    i = spec.moe.intermediate_size
    part = 0 if which == "gate" else 1
    return [(tensor[e, part * i:(part + 1) * i], _ALL, attr)]


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


class _Coverage:
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
                       named_tensors: Iterable[tuple[str, torch.Tensor]], coverage: _Coverage | None = None) -> set[str]:
    """Copy each full `(hf_name, tensor)` (a shard: its slice) into the engine's weights in place;
    returns the names copied."""
    done: set[str] = set()
    for name, tensor in named_tensors:
        found = _keyed_targets(weights, spec, name)
        for dst, index, _ in found:
            _copy_into(dst, tensor.detach()[index], name)
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
    coverage = _Coverage()
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

    spec = _shard_spec(config, shard)
    files = safetensors_files(path)
    names: set[str] = set()
    for fname in files:
        with safe_open(fname, framework="pt") as f:
            names.update(f.keys())
    weights = allocate_weights(spec, names, dtype, device)
    coverage = _Coverage()
    for fname in files:
        with safe_open(fname, framework="pt") as f:
            for name in f.keys():
                found = _keyed_targets(weights, spec, name)
                for dst, index, _ in found:
                    piece = f.get_slice(name)[index] if index != _ALL else f.get_tensor(name)
                    _copy_into(dst, piece.to(dst.dtype), name)
                coverage.add(name, found)
    coverage.check(spec, weights)
    return spec, weights
