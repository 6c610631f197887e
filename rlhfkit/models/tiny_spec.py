"""What a tiny model is (rlhfkit.models.tiny builds it): `TinyModelSpec`, whose fields are make_tiny_model's
architecture flags (declared here, rlhfkit.config.declare; quickstart takes the two size flags), and the
families it can be. No torch, so a command's --help does not load it."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.declare import flag

VLM_ARCHS = ("qwen2_5_vl", "qwen3_vl")
TEXT_ARCHS = ("llama", "qwen2", "mixtral", "gemma3_text", "qwen3_moe", "gpt_oss", "phi3", "olmo2", "olmo3")
ARCHS = TEXT_ARCHS + VLM_ARCHS
TINY_SEED = 0  # make_tiny_model's --seed (its parser's default)


@dataclass
class TinyModelSpec:
    arch: str = flag("llama", choices=ARCHS,
                     help="transformers model family (mixtral: a mixture of experts; qwen2_5_vl, qwen3_vl: "
                          "vision-language models with an image processor)")
    hidden_size: int = flag(128, help="width of the residual stream")
    num_hidden_layers: int = flag(4, "--num_layers", help="transformer blocks")
    num_attention_heads: int = flag(4, help="query heads per attention layer")
    num_key_value_heads: int | None = flag(
        None, help="key/value heads (grouped-query attention; default: --num_attention_heads)")
    intermediate_size: int | None = flag(None, help="MLP width (default: the family's rule)")
    max_position_embeddings: int = flag(512, help="longest sequence in tokens")
    tie_word_embeddings: bool = flag(False, help="share the input embedding and the output head")
    seed: int = TINY_SEED  # --seed is declared once, by rlhfkit.config.configs.BackendFlags
