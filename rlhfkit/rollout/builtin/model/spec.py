"""The builtin engine's description of a model: `ModelSpec`, read from a Hugging Face decoder-only config.

Supported families (`config.model_type`, model/families.py): llama, mistral, qwen2, qwen3, phi3, olmo2,
olmo3, gemma3_text, qwen3_moe, gpt_oss, and the language models of the vision-language qwen2_vl,
qwen2_5_vl (a qwen2 block) and qwen3_vl (a qwen3 block), whose vision tower lives in model/vision.py.
model/families.py draws the one block they share and what each family changes in it.

Tensor parallelism (column- and row-parallel projections): `ModelSpec.shard(rank,
size, group)` is the spec of one of `size` shards. A shard holds its own query heads (and the KV
heads they read; with fewer KV heads than shards each KV head is replicated on size / kv ranks),
its slice of the MLP's intermediate dimension (gate/up rows, down columns), the o projection's
columns for its heads, and its rows of the lm_head (vocab-parallel, ceil(V / size) rows, the last
shard zero-padded); embedding, norms and biases of o / down are replicated. Loading and weight
updates (weights.py) take *full* HF tensors and copy each shard's slice (`targets`: destination view + source
index), so every sender stays shard-agnostic; `load_from_safetensors` reads only a shard's slices
from the files (a 32B model never sits whole in host memory). Routed experts and OLMo's q/k norms
over the whole projection are not sharded: such engines run on one device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlhfkit.models.hf_config import ConfigFields
from rlhfkit.rollout.builtin.model.families import (FAMILIES, SUPPORTED_MODEL_TYPES, Family, LayerKind, MoESpec,
                                                    layer_types, moe_layers, moe_spec)

VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # their language model (`text_config`) is the decoder here
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
        factor = float(rope_params(config).get("partial_rotary_factor", f.partial_rotary_factor) or 1.0)
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


def rope_params(config) -> dict:
    """The config's rope parameters (for a per-layer-type rope: the full-attention layers')."""
    params = dict(ConfigFields.of(config).rope_parameters or {})
    if params and set(params) <= set(ROPE_LAYER_TYPES):
        return dict(params.get("full_attention") or {})
    return params


def per_type_rope(config) -> bool:
    params = ConfigFields.of(config).rope_parameters or {}
    return bool(params) and set(params) <= set(ROPE_LAYER_TYPES)


def _layer_kinds(config, family: Family) -> list[LayerKind]:
    types, moe = layer_types(config), moe_layers(config, family)
    window = ConfigFields.of(config).sliding_window
    per_type = per_type_rope(config)
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


def shard_spec(config, shard: tuple[int, int, str | None] | None) -> ModelSpec:
    spec = ModelSpec.from_hf_config(config)
    return spec.shard(*shard) if shard is not None and shard[1] > 1 else spec
