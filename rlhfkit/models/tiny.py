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

import torch

from rlhfkit.models.tiny_spec import ARCHS, VLM_ARCHS, TinyModelSpec

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, BOS, EOS, UNK, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


TINY_WINDOW = 8  # the sliding window of the tiny windowed families: a short generation crosses it


def _alternating(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def build_config(spec: TinyModelSpec, vocab_size: int, tok):
    """The HF config of a tiny `spec.arch` model. The families beyond Llama keep what sets them apart
    at tiny size: Gemma 3 local / global layers with a window of TINY_WINDOW tokens and two rope
    tables, Qwen3-MoE 8 experts (top 2) with one dense layer, gpt-oss 4 experts (top 2) with
    attention sinks and windows, Phi-3 half the head dims rotary, OLMo 3 windows."""
    import transformers

    heads = spec.num_attention_heads
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=spec.num_key_value_heads or heads,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rms_norm_eps=1e-6,
    )
    n, head_dim = spec.num_hidden_layers, spec.hidden_size // heads
    arch = spec.arch
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "gemma3_text":
        return transformers.Gemma3TextConfig(
            **common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=TINY_WINDOW,
            layer_types=_alternating(n), rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, head_dim=head_dim, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            moe_intermediate_size=max(16, spec.hidden_size // 2), mlp_only_layers=[n - 1] if n > 1 else [])
    if arch == "gpt_oss":
        gpt = {**common, "intermediate_size": max(16, spec.hidden_size // 2)}
        return transformers.GptOssConfig(**gpt, head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=TINY_WINDOW, layer_types=_alternating(n))
    if arch == "phi3":
        return transformers.Phi3Config(**common, partial_rotary_factor=0.5)
    if arch == "olmo2":
        return transformers.Olmo2Config(**common)
    if arch == "olmo3":
        return transformers.Olmo3Config(**common, sliding_window=TINY_WINDOW, layer_types=_alternating(n))
    raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")


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
