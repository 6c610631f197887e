"""Model description and weights of the builtin engine, read from a Hugging Face decoder-only model.

Supported families (`config.model_type`): llama, qwen2, qwen3, mistral. They share one block:

    x -> RMSNorm -> q,k,v projections (optional bias; Qwen3: RMSNorm on each head of q and k)
      -> RoPE -> attention (grouped-query) -> o projection -> + x
      -> RMSNorm -> down(silu(gate(h)) * up(h)) -> + x

The engine keeps its own copy of the weights, with q/k/v fused into one matrix and gate/up into
another (two GEMMs fewer per layer and step). `WeightNames` maps every Hugging Face parameter name
to a view of a fused tensor, so loading and `update_weights` are one code path: `copy_` into that
view, in place. The tensors never move while the engine is awake, so CUDA graphs captured over
them stay valid after a weight update.

RoPE follows Su et al. 2021 ("RoFormer", arXiv 2104.09864) in Hugging Face's rotate-half layout;
frequencies for scaled variants (linear, llama3, yarn) come from transformers' own
`ROPE_INIT_FUNCTIONS`, so they match the reference model exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelSpec:
    """Shapes and constants of one decoder-only model."""

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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        model_type = getattr(config, "model_type", "")
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
            qk_norm=model_type == "qwen3",
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
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


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
_LAYER_PARTS = {  # HF suffix -> (fused attribute, part index among the fused pieces)
    "self_attn.q_proj.weight": ("qkv", 0), "self_attn.k_proj.weight": ("qkv", 1),
    "self_attn.v_proj.weight": ("qkv", 2), "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1), "self_attn.v_proj.bias": ("qkv_bias", 2),
    "self_attn.o_proj.weight": ("o", None), "self_attn.o_proj.bias": ("o_bias", None),
    "self_attn.q_norm.weight": ("q_norm", None), "self_attn.k_norm.weight": ("k_norm", None),
    "mlp.gate_proj.weight": ("gate_up", 0), "mlp.up_proj.weight": ("gate_up", 1),
    "mlp.gate_proj.bias": ("gate_up_bias", 0), "mlp.up_proj.bias": ("gate_up_bias", 1),
    "mlp.down_proj.weight": ("down", None), "mlp.down_proj.bias": ("down_bias", None),
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_norm", None),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def _part_bounds(spec: ModelSpec, attr: str, part: int) -> tuple[int, int]:
    if attr.startswith("qkv"):
        sizes = [spec.q_size, spec.kv_size, spec.kv_size]
    else:
        sizes = [spec.intermediate_size, spec.intermediate_size]
    start = sum(sizes[:part])
    return start, start + sizes[part]


def target_view(weights: ModelWeights, spec: ModelSpec, name: str) -> torch.Tensor | None:
    """The engine tensor (or view of a fused tensor) that HF parameter `name` is copied into.

    Returns None for buffers the engine recomputes (rotary inv_freq); raises KeyError for
    names that belong to no weight of this model.
    """
    if name.startswith("module."):
        name = name[len("module."):]
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if name == "model.embed_tokens.weight":
        return weights.embed
    if name == "model.norm.weight":
        return weights.final_norm
    if name == "lm_head.weight":
        return weights.lm_head
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in _LAYER_PARTS or int(m.group(1)) >= len(weights.layers):
        raise KeyError(f"weight {name!r} has no place in the builtin engine's {spec.model_type} model")
    attr, part = _LAYER_PARTS[m.group(2)]
    tensor = getattr(weights.layers[int(m.group(1))], attr)
    if tensor is None:
        raise KeyError(f"weight {name!r}: the engine's model was built without {attr} "
                       "(the config and the weights disagree)")
    if part is None:
        return tensor
    start, end = _part_bounds(spec, attr, part)
    return tensor[start:end]


def copy_named_tensors(weights: ModelWeights, spec: ModelSpec,
                       named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each `(hf_name, tensor)` into the engine's weights in place; returns the names copied."""
    done: set[str] = set()
    for name, tensor in named_tensors:
        dst = target_view(weights, spec, name)
        if dst is None:
            continue
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the engine's "
                             f"{tuple(dst.shape)}")
        dst.copy_(tensor.detach())
        done.add(name)
    return done


def _has_bias(names: set[str], suffix: str) -> bool:
    return any(n.endswith(suffix) for n in names)


def allocate_weights(spec: ModelSpec, names: set[str], dtype: torch.dtype,
                     device: torch.device) -> ModelWeights:
    """Empty engine tensors shaped for `spec`; optional biases exist when `names` holds them."""
    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

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
    lm_head = embed if spec.tie_word_embeddings else empty(spec.vocab_size, h)
    return ModelWeights(embed=embed, final_norm=empty(h), lm_head=lm_head, layers=layers)


def load_from_hf_model(model: torch.nn.Module, dtype: torch.dtype,
                       device: torch.device) -> tuple[ModelSpec, ModelWeights]:
    """Build the engine's spec and weights from an HF `*ForCausalLM` module (the module is not kept)."""
    spec = ModelSpec.from_hf_config(model.config)
    state = model.state_dict()
    weights = allocate_weights(spec, set(state), dtype, device)
    loaded = copy_named_tensors(weights, spec, state.items())
    needed = {"model.embed_tokens.weight", "model.norm.weight"}
    if not spec.tie_word_embeddings:
        needed.add("lm_head.weight")
    missing = sorted(needed - loaded)
    if missing:
        raise ValueError(f"the model's state dict lacks {missing}")
    expected_per_layer = 9 + (2 if spec.qk_norm else 0)
    for li in range(spec.num_layers):
        n = sum(1 for k in loaded if k.startswith(f"model.layers.{li}.") and "bias" not in k)
        if n != expected_per_layer:
            raise ValueError(f"layer {li}: found {n} weight matrices/norms, expected {expected_per_layer}")
    return spec, weights
