"""The model families of the builtin engine: how each one's decoder block departs from Llama's.

One block serves every family (model/decoder.py); a `Family` names what differs, and `ModelSpec` (model/spec.py)
turns an HF config into the shapes plus one `LayerKind` per layer:

    x -> [input norm] -> q,k,v (+bias) -> [q/k norm] -> RoPE -> attention -> o (+bias) -> [out norm] -> + x
      -> [mlp norm]   -> MLP or routed experts                                          -> [out norm] -> + x

    family       norm    q/k norm   pre / post norms   MLP                         attention
    llama,       llama   -          pre                SiLU-gated                  full (Mistral: a window)
    mistral,
    qwen2
    qwen3        llama   per head   pre                SiLU-gated                  full
    phi3         llama   -          pre                SiLU-gated (fused names)    full, partial rotary
    olmo2/olmo3  fp32    whole q/k  post only          SiLU-gated                  full (OLMo 3: windows)
    gemma3_text  gemma   per head   pre and post       GELU(tanh)-gated            windows + full, 2 rope
                                                                                   tables, scaled embeddings
    qwen3_moe    llama   per head   pre                top-k of softmax experts    full
    gpt_oss      fp32    -          pre                softmax of top-k experts,   sinks, windows + full
                                                       clamped SwiGLU, biases

Norm styles (the three RMSNorm roundings of Hugging Face): "llama" `w * cast(x_hat)`, "fp32"
`cast(w * x_hat)` and "gemma" `cast((1 + w) * x_hat)`, with x_hat normalised in fp32
(x_hat = x / sqrt(mean(x^2) + eps)).

Routers (top-k mixture-of-experts gating):
"softmax_topk" takes the top k of softmax(logits) (Qwen3-MoE; renormalised to sum 1 with
`norm_topk_prob`), "topk_softmax" the softmax of the top k logits (gpt-oss). Attention sinks
(gpt-oss) are one learned logit per head that joins every
softmax's denominator and carries no value.

`NAMES[family]` maps an HF parameter suffix (after `model.layers.N.`) to where it goes in the
engine's `LayerWeights`: `(attribute, part, how)`, where `part` is the index of the piece in a fused
engine tensor (q/k/v in `qkv`, gate/up in `gate_up`), "all" when one HF tensor fills every piece
(Phi-3's fused `qkv_proj` / `gate_up_proj`) or "T" when the HF tensor is the engine tensor
transposed (gpt-oss keeps its experts as `[E, in, out]`), and `how` says which dimension a
tensor-parallel shard slices (model/weights.py `_source_index`). Per-expert names of checkpoints on disk
(`mlp.experts.E.gate_proj.weight`, ...) are matched by `EXPERT_RE`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rlhfkit.models.hf_config import ConfigFields

# an HF tensor name's place in a decoder block: (engine attribute, which part of it: an index into a
# fused tensor, "all" of a fused one, "T" transposed, None the whole; what its rows are split by)
NameRule = tuple[str, int | Literal["all", "T"] | None, str | None]

NORM_STYLES = ("llama", "fp32", "gemma")
ROUTERS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class Family:
    """What one HF model family's decoder block does differently from Llama's (module docstring)."""

    norm: str = "llama"
    qk_norm: str | None = None  # "head": RMSNorm over each head's dims; "full": over the whole projection
    pre_norms: bool = True  # RMSNorm before attention and before the MLP
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs, before the residual add
    act: str = "silu"  # "silu" or "gelu_tanh" (the MLP's gate activation)
    embed_scale: bool = False  # token embeddings times sqrt(hidden_size), rounded to the model dtype
    router: str | None = None  # None: dense MLP; else the routed experts' router (ROUTERS)
    expert_act: str = "silu"  # "silu" or "clamped_swiglu" (gpt-oss: interleaved gate / up, clamped)
    sinks: bool = False  # one learned attention-sink logit per query head
    fp32_norm_weights: bool = False  # HF keeps the norm weights in fp32 (`_keep_in_fp32_modules`)
    names: dict[str, NameRule] = field(default_factory=dict)


_ATTN: dict[str, NameRule] = {
    "self_attn.q_proj.weight": ("qkv", 0, "q"), "self_attn.k_proj.weight": ("qkv", 1, "kv"),
    "self_attn.v_proj.weight": ("qkv", 2, "kv"), "self_attn.q_proj.bias": ("qkv_bias", 0, "q"),
    "self_attn.k_proj.bias": ("qkv_bias", 1, "kv"), "self_attn.v_proj.bias": ("qkv_bias", 2, "kv"),
    "self_attn.o_proj.weight": ("o", None, "q_in"), "self_attn.o_proj.bias": ("o_bias", None, None),
    "self_attn.q_norm.weight": ("q_norm", None, None), "self_attn.k_norm.weight": ("k_norm", None, None),
}
_MLP: dict[str, NameRule] = {
    "mlp.gate_proj.weight": ("gate_up", 0, "i"), "mlp.up_proj.weight": ("gate_up", 1, "i"),
    "mlp.gate_proj.bias": ("gate_up_bias", 0, "i"), "mlp.up_proj.bias": ("gate_up_bias", 1, "i"),
    "mlp.down_proj.weight": ("down", None, "i_in"), "mlp.down_proj.bias": ("down_bias", None, None),
}
_LLAMA: dict[str, NameRule] = {**_ATTN, **_MLP, "input_layernorm.weight": ("input_norm", None, None),
          "post_attention_layernorm.weight": ("mlp_norm", None, None)}
_GEMMA3: dict[str, NameRule] = {**_ATTN, **_MLP, "input_layernorm.weight": ("input_norm", None, None),
           "post_attention_layernorm.weight": ("attn_out_norm", None, None),
           "pre_feedforward_layernorm.weight": ("mlp_norm", None, None),
           "post_feedforward_layernorm.weight": ("mlp_out_norm", None, None)}
_OLMO2: dict[str, NameRule] = {**_ATTN, **_MLP, "post_attention_layernorm.weight": ("attn_out_norm", None, None),
          "post_feedforward_layernorm.weight": ("mlp_out_norm", None, None)}
_PHI3: dict[str, NameRule] = {"self_attn.qkv_proj.weight": ("qkv", "all", "qkv"), "self_attn.o_proj.weight": ("o", None, "q_in"),
         "mlp.gate_up_proj.weight": ("gate_up", "all", "gate_up"), "mlp.down_proj.weight": ("down", None, "i_in"),
         "input_layernorm.weight": ("input_norm", None, None),
         "post_attention_layernorm.weight": ("mlp_norm", None, None)}
_QWEN3_MOE: dict[str, NameRule] = {**_LLAMA, "mlp.gate.weight": ("router", None, None),
              "mlp.experts.gate_up_proj": ("experts_gate_up", None, None),
              "mlp.experts.down_proj": ("experts_down", None, None)}
_GPT_OSS: dict[str, NameRule] = {**_LLAMA, "self_attn.sinks": ("sinks", None, "heads"),
            "mlp.router.weight": ("router", None, None), "mlp.router.bias": ("router_bias", None, None),
            "mlp.experts.gate_up_proj": ("experts_gate_up", "T", None),
            "mlp.experts.gate_up_proj_bias": ("experts_gate_up_bias", None, None),
            "mlp.experts.down_proj": ("experts_down", "T", None),
            "mlp.experts.down_proj_bias": ("experts_down_bias", None, None)}

# per-expert names of checkpoints on disk: mlp.experts.E.{gate,up,down}_proj.weight
EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")

_DENSE = Family(names=_LLAMA)
FAMILIES: dict[str, Family] = {
    "llama": _DENSE, "mistral": _DENSE, "qwen2": _DENSE, "qwen2_vl": _DENSE, "qwen2_5_vl": _DENSE,
    "qwen3": Family(qk_norm="head", names=_LLAMA), "qwen3_vl": Family(qk_norm="head", names=_LLAMA),
    "phi3": Family(names=_PHI3),
    "olmo2": Family(norm="fp32", qk_norm="full", pre_norms=False, post_norms=True, names=_OLMO2),
    "olmo3": Family(norm="fp32", qk_norm="full", pre_norms=False, post_norms=True, names=_OLMO2),
    "gemma3_text": Family(norm="gemma", qk_norm="head", post_norms=True, act="gelu_tanh", embed_scale=True,
                          names=_GEMMA3),
    "qwen3_moe": Family(qk_norm="head", router="softmax_topk", names=_QWEN3_MOE),
    "gpt_oss": Family(norm="fp32", router="topk_softmax", expert_act="clamped_swiglu", sinks=True,
                      fp32_norm_weights=True, names=_GPT_OSS),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


@dataclass(frozen=True)
class LayerKind:
    """What varies between the layers of one model: the attention window (None: full attention;
    key j is visible from query i iff i - window < j <= i), which rope table the layer rotates
    with, and whether its MLP is routed experts. Layers of one kind share one compiled graph."""

    window: int | None = None
    rope: int = 0
    moe: bool = False


@dataclass(frozen=True)
class MoESpec:
    """Routed experts: `num_experts` MLPs of width `intermediate_size`, `top_k` per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str
    norm_topk_prob: bool = False
    bias: bool = False
    act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def moe_spec(config, family: Family) -> MoESpec | None:
    """The routed experts of `config` (None for a dense family)."""
    if family.router is None:
        return None
    if family.router == "topk_softmax":  # gpt-oss
        return MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.intermediate_size, router=family.router, bias=True,
                       act=family.expert_act, swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                       swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)))
    return MoESpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                   intermediate_size=config.moe_intermediate_size, router=family.router,
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)), act=family.expert_act)


def moe_layers(config, family: Family) -> list[bool]:
    """Which layers hold routed experts: every one for gpt-oss; Qwen3-MoE skips `mlp_only_layers`
    and keeps every `decoder_sparse_step`-th."""
    n = config.num_hidden_layers
    if family.router is None:
        return [False] * n
    if family.router == "topk_softmax":
        return [True] * n
    skip = set(ConfigFields.of(config).mlp_only_layers or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return [i not in skip and config.num_experts > 0 and (i + 1) % step == 0 for i in range(n)]


def layer_types(config) -> list[str]:
    """Each layer's attention type ("full_attention" or "sliding_attention"): the config's
    `layer_types`, else every layer windowed when the config has a sliding window (Mistral)."""
    n, f = config.num_hidden_layers, ConfigFields.of(config)
    if f.layer_types:
        return list(f.layer_types)[:n]
    if f.sliding_window is not None and f.use_sliding_window is not False:
        return ["sliding_attention"] * n
    return ["full_attention"] * n
