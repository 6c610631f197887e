"""Offline tokenizers shaped like real families' (importable as `tokenizer_kinds`: tests/ is on sys.path
through its conftest), character-level like rlhfkit.models.tiny's, for the BOS rule and the saved reward
model's tokenizer:

* `gemma3_like()`: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `<start_of_turn>`, `<end_of_turn>`; a
  post-processor that puts `<bos>` before the text (Gemma 3's `tokenizer("x")`), and a Gemma-style chat
  template that writes `<bos>` itself and ends each turn with `<end_of_turn>\\n` (EOS is `<eos>`).
* `smollm2_like()`: SmolLM2-Instruct's specials (`<|im_start|>` is BOS, `<|im_end|>` is EOS and pad), no
  BOS added, its ChatML template with the default system message.

`save_tiny_model(tok, path)` writes a 2-layer Llama for either (the tiny model's shapes).
"""

from __future__ import annotations

import string

GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') -}}"
    "{{- message['content'] | trim -}}"
    "{{- '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _char_tokenizer(specials: list[str], bos_post_processor: str | None = None):
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = {tok: i for i, tok in enumerate(specials)}
    for c in string.printable:
        if c not in "\x0b\x0c\r":
            vocab.setdefault(c, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>" if "<unk>" in vocab else None))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    if bos_post_processor is not None:
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos_post_processor} $A", pair=f"{bos_post_processor} $A $B",
            special_tokens=[(bos_post_processor, vocab[bos_post_processor])])
    return core


def gemma3_like():
    from transformers import PreTrainedTokenizerFast

    core = _char_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "<bos>")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
                                  add_bos_token=True, add_eos_token=False, padding_side="right")
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    return tok


def smollm2_like():
    from transformers import PreTrainedTokenizerFast

    core = _char_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"], padding_side="right")
    tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tok


def save_tiny_model(tok, path: str, seed: int = 0) -> str:
    """`tok` and a random 2-layer, hidden-64 Llama over its vocabulary, saved in `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhfkit.models.tiny import TinyModelSpec, build_config

    spec = TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=256, seed=seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(spec, len(tok), tok))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
