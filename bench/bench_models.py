"""Offline model directories for the benchmarks: random weights of a named shape + a tokenizer.

    make_bench_model(path, "tiny")         # hidden 128, 4 layers, the character tokenizer (rlhfkit.models.tiny)
    make_bench_model(path, "qwen2-0.5b")   # Qwen2-0.5B's shape, bf16, a 151936-entry offline tokenizer

Nothing is downloaded. The 0.5B shape needs a tokenizer whose vocabulary covers every id the
random model can sample, so that any completion decodes: `build_filler_tokenizer(vocab_size)`
makes a character-level BPE (no merges) over the printable characters, the ChatML special tokens
and filler tokens "<t123>" up to `vocab_size`. Text encodes one character per token (so a prompt
of k characters is k tokens); a filler id decodes to its "<t123>" string.
"""

from __future__ import annotations

import os
import string
from typing import Any

import torch

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=512, max_position_embeddings=4096)
SHAPES = ("tiny", "qwen2-0.5b")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def filler_vocab(vocab_size: int) -> dict[str, int]:
    """specials, then printable characters, then "<t{i}>" fillers: exactly `vocab_size` entries."""
    vocab: dict[str, int] = {}
    for tok in (ENDOFTEXT, IM_START, IM_END):
        vocab[tok] = len(vocab)
    for c in string.printable:
        if c not in "\x0b\x0c\r":
            vocab.setdefault(c, len(vocab))
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(vocab)} special + character tokens")
    i = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<t{i}>"] = i
        i += 1
    return vocab


def build_filler_tokenizer(vocab_size: int) -> Any:
    """A fast tokenizer with exactly `vocab_size` ids, ChatML template, eos <|im_end|>, pad <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab=filler_vocab(vocab_size), merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([ENDOFTEXT, IM_START, IM_END])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT,
                                  additional_special_tokens=[IM_START], padding_side="right")
    tok.chat_template = CHATML
    if len(tok) != vocab_size:
        raise AssertionError(f"filler tokenizer has {len(tok)} ids, expected {vocab_size}")
    return tok


def _qwen2_config(shape: dict, tok: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id)


def make_bench_model(path: str, shape: str, device: str | None = None, seed: int = 0) -> str:
    """Write a random-init model of `shape` ("tiny" | "qwen2-0.5b") and its tokenizer to `path`.

    The 0.5B model is initialised on `device` (default cpu; cuda is much faster) and saved in
    bf16; the tiny one is saved in fp32. Returns `path`. An existing complete directory is reused.
    """
    if shape not in SHAPES:
        raise ValueError(f"--model must be one of {SHAPES}, got {shape!r}")
    if os.path.exists(os.path.join(path, "config.json")) and os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from transformers import AutoModelForCausalLM

    if shape == "tiny":
        from rlhfkit.models.tiny import build_tokenizer

        tok, cfg_shape, dtype = build_tokenizer(), dict(TINY), torch.float32
        cfg_shape["vocab_size"] = len(tok)
    else:
        tok, cfg_shape, dtype = build_filler_tokenizer(QWEN2_05B["vocab_size"]), dict(QWEN2_05B), torch.bfloat16
    config = _qwen2_config(cfg_shape, tok)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tok, key))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    return path


def random_prompt(rng: Any, n_chars: int) -> str:
    """`n_chars` random lowercase letters and spaces (one token each with both tokenizers here)."""
    alphabet = string.ascii_lowercase + " "
    return "".join(alphabet[int(i)] for i in rng.integers(0, len(alphabet), size=n_chars))


__all__ = ["SHAPES", "QWEN2_05B", "TINY", "make_bench_model", "build_filler_tokenizer", "filler_vocab",
           "random_prompt"]
