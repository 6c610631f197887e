"""Rotary position embeddings of the builtin engine: the cos / sin tables of a model (`rope_table_set`).

Rotary position embeddings in Hugging Face's rotate-half layout;
frequencies for scaled variants (linear, llama3, yarn, longrope within its original length) come
from transformers' own `ROPE_INIT_FUNCTIONS`, so they match the reference model exactly. A family
with one rope per layer type (Gemma 3: local and global layers) gets one table per type; a partial
rotary dimension (Phi-3 variants) is a table whose columns past it are cos 1, sin 0.
"""

from __future__ import annotations

import torch

from rlhfkit.models.hf_config import ConfigFields
from rlhfkit.rollout.builtin.model.families import layer_types
from rlhfkit.rollout.builtin.model.spec import ROPE_LAYER_TYPES, VLM_MODEL_TYPES, ModelSpec, per_type_rope, rope_params

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _table_layer_types(config, spec: ModelSpec) -> list[str | None]:
    """The HF layer type behind each rope table index (None: the config has one rope)."""
    if not per_type_rope(config):
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
    if layer_type is None and per_type_rope(config):  # one rope per layer type: the full-attention layers'
        layer_type = "full_attention" if "full_attention" in config.rope_parameters else "sliding_attention"
    params = dict(config.rope_parameters[layer_type] or {}) if layer_type is not None else rope_params(config)
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
