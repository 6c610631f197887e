"""A module's Hugging Face config, and the config's optional fields as one typed record.

transformers has a config class per model family, and a field one family declares (`sliding_window`,
`layer_types`, `head_dim`, `rope_parameters`, ...) another lacks. `ConfigFields.of(config)` reads every
optional field rlhfkit plans a model with, a field the config lacks taking the default declared here
(what the family's modeling code assumes without it); the code that sizes, checks or rebuilds a model
reads these typed attributes instead of probing the config. Fields every causal LM config has
(`hidden_size`, `num_attention_heads`, `num_hidden_layers`, ...) are read from the config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def config_of(model: nn.Module) -> PretrainedConfig | None:
    """The Hugging Face config of `model` (an HF or rlhfkit value model, possibly FSDP-wrapped); None
    for a module without one."""
    from transformers import PretrainedConfig

    config = getattr(model, "config", None)
    return config if isinstance(config, PretrainedConfig) else None


@dataclass(frozen=True)
class ConfigFields:
    """The optional fields of one HF text-model config (see the module docstring)."""

    model_type: str = ""
    num_key_value_heads: int | None = None  # None: as many as the query heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool | None = None
    hidden_activation: str | None = None  # Gemma's name of the MLP activation (others: hidden_act)
    hidden_act: str = "silu"
    sliding_window: int | None = None
    use_sliding_window: bool = True
    layer_types: list[str] | None = None  # each layer's "full_attention" | "sliding_attention"
    mlp_only_layers: list[int] | None = None  # Qwen3-MoE: layers with a dense MLP
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None  # transformers < 5's name of the rope parameters
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = None
    dtype: torch.dtype | str | None = None  # the checkpoint's dtype (transformers < 5: torch_dtype)
    pad_token_id: int | None = None

    @classmethod
    def of(cls, config: Any) -> ConfigFields:
        """The fields of `config`, each missing one at its default."""
        return cls(**{f.name: getattr(config, f.name, f.default) for f in fields(cls)})
