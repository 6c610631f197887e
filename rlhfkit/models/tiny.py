"""Offline tiny models: a character-level tokenizer and a small random causal LM.

Nothing is downloaded. The result is a normal Hugging Face directory:

    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)

(`--arch qwen2_5_vl` / `qwen3_vl`: a vision-language model and its image processor, built by
`rlhfkit.models.tiny_vlm`.)

The tokenizer maps each printable ASCII character to one token, has `<pad>`, `<s>`,
`</s>`, `<unk>` and the ChatML markers `<|im_start|>` / `<|im_end|>`, and a ChatML chat
template, so `--apply_chat_template` works on it.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass

import torch

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, BOS, EOS, UNK, IM_START, IM_END]
VLM_ARCHS = ("qwen2_5_vl", "qwen3_vl")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class TinyModelSpec:
    arch: str = "llama"  # llama | qwen2 | mixtral (4 experts, top 2) | qwen2_5_vl | qwen3_vl (vision-language)
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None  # default 4 x hidden
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    seed: int = 0


def build_tokenizer(extra_specials: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE):
    """A character-level fast tokenizer (a BPE model with no merges); `extra_specials` are added
    as special tokens after the ChatML markers (a VLM's vision tokens)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    specials = SPECIALS + list(extra_specials)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    for t in extra_specials:
        vocab.setdefault(t, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END, *extra_specials],
        padding_side="right",
    )
    tok.chat_template = chat_template
    return tok


def build_config(spec: TinyModelSpec, vocab_size: int, tok):
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads or spec.num_attention_heads,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rms_norm_eps=1e-6,
    )
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "qwen2":
        return Qwen2Config(**common)
    if spec.arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(f"--arch must be llama, qwen2, mixtral, qwen2_5_vl or qwen3_vl, got {spec.arch!r}")


def make_tiny_model(save_path: str, spec: TinyModelSpec | None = None) -> str:
    """Write tokenizer + random model to `save_path` and return it."""
    from transformers import AutoModelForCausalLM

    spec = spec or TinyModelSpec()
    if spec.arch in VLM_ARCHS:
        from rlhfkit.models.tiny_vlm import VISION_SPECIALS, VLM_CHAT_TEMPLATE, make_tiny_vlm

        return make_tiny_vlm(save_path, spec, build_tokenizer(VISION_SPECIALS, VLM_CHAT_TEMPLATE))
    tok = build_tokenizer()
    config = build_config(spec, len(tok), tok)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    os.makedirs(save_path, exist_ok=True)
    model.save_pretrained(save_path, safe_serialization=True)
    tok.save_pretrained(save_path)
    return save_path
