"""Import a GGUF model file (llama.cpp's format) into a Hugging Face model folder, offline.

    result = import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "./smollm2", param_dtype="bf16")
    python -m rlhfkit.cli.import_gguf --gguf FILE --save_path DIR [--param_dtype bf16]

transformers reads the file (with the `gguf` package): the config, the tokenizer with its chat
template, and the tensors, dequantized. A model loaded that way is marked quantized and refuses
`save_pretrained`, so the weights are moved into a model built from the same config without its
`quantization_config`, cast to `param_dtype` and saved (safetensors) with the tokenizer and a
generation_config, through a staging folder (rlhfkit.fileio: the folder loads whole or not at all).

End of turn: a chat model stops at the token that ends an assistant turn in its chat template
(`<|im_end|>` in ChatML), but the tokenizer a GGUF file gives may name another token eos (SmolLM2's
names `<|im_start|>` under transformers 5.17) and may have no pad token. Generation would then run
past the answer, and SFT would teach the wrong end. `chat_turn_end` renders a two-message
conversation with the template and takes the special token that follows the assistant's text;
where it differs from eos, it becomes the eos of the tokenizer, the config and the
generation_config, and the pad token too where there was none or it was the old eos. Every change is
returned in `GgufImport.repairs` (and logged by the command); a tokenizer without a chat template,
or whose template ends a turn with no special token, is saved as it was read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from rlhfkit.optional import require

log = logging.getLogger(__name__)

_MARK = "rlhfkit-turn-end-probe"


@dataclass(frozen=True)
class GgufImport:
    """What `import_gguf` wrote: the folder, the model family, the saved dtype, the parameter count,
    and the eos / pad changes (one line each; empty when the file's tokens were kept)."""

    save_path: str
    model_type: str
    param_dtype: str
    num_parameters: int
    eos_token: str | None
    pad_token: str | None
    repairs: list[str] = field(default_factory=list)


def chat_turn_end(tokenizer: Any) -> str | None:
    """The special token that ends an assistant turn under `tokenizer`'s chat template, or None (no
    template, the template fails on a user + assistant conversation, or no special token follows the
    assistant's text)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template may reject any conversation it was not written for
        return None
    if not isinstance(text, str) or _MARK not in text:
        return None
    after = text.split(_MARK, 1)[1].lstrip()
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    found = [s for s in specials if s and after.startswith(s)]
    return max(found, key=len) if found else None


def repair_chat_eos(tokenizer: Any, config: Any, generation_config: Any) -> list[str]:
    """Make the chat template's end of turn the eos (and the missing or old-eos pad) of the tokenizer,
    config and generation_config; returns one line per change (module docstring)."""
    turn_end = chat_turn_end(tokenizer)
    repairs: list[str] = []
    old_eos = tokenizer.eos_token
    if turn_end is not None and turn_end != old_eos:
        tokenizer.eos_token = turn_end
        repairs.append(f"tokenizer eos_token {old_eos!r} -> {turn_end!r} (the chat template's end of turn)")
    eos = tokenizer.eos_token
    if eos is not None and (tokenizer.pad_token is None or (turn_end is not None and tokenizer.pad_token == old_eos
                                                            and old_eos != eos)):
        repairs.append(f"tokenizer pad_token {tokenizer.pad_token!r} -> {eos!r}")
        tokenizer.pad_token = eos
    for name, obj in (("config", config), ("generation_config", generation_config)):
        for key, want in (("eos_token_id", tokenizer.eos_token_id), ("pad_token_id", tokenizer.pad_token_id)):
            have = getattr(obj, key, None)
            if want is not None and have != want:
                setattr(obj, key, want)
                repairs.append(f"{name} {key} {have!r} -> {want!r}")
    return repairs


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, the GGUF file is parsed once and each name table built once. transformers reads
    the file three times (config, tokenizer, weights), each time parsing every metadata field anew (a
    49k-token vocabulary field by field: 4 s each of SmolLM2's 22 s import), and it asks
    `gguf.get_tensor_name_map(arch, layers)` once per tensor, which builds the same read-only table again
    (5-6 s): the block hands back one reader per file and one table per (arch, layers)."""
    import gguf

    build, open_reader = gguf.get_tensor_name_map, gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:  # transformers imports it from gguf at each call
        key = (os.path.abspath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = open_reader(path, mode)
        return readers[key]

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build)
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = build, open_reader


def import_gguf(gguf_path: str, save_path: str, param_dtype: str = "bf16", flag: str = "--gguf") -> GgufImport:
    """Dequantize the causal LM in `gguf_path` into a Hugging Face folder `save_path` (weights in
    `param_dtype`: bf16 | fp16 | fp32), with its tokenizer, eos / pad repaired for chat (module
    docstring). `flag` names the file in errors."""
    require("gguf", "import_gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # a transformers that keeps it elsewhere: the random init runs, to no effect
        from contextlib import nullcontext as no_init_weights

    from rlhfkit.fileio import new_staging_dir, publish_staged
    from rlhfkit.models.hf_files import resolve_dtype

    dtype = resolve_dtype(param_dtype)
    if not os.path.isfile(gguf_path):
        what = "a directory, not a .gguf file" if os.path.isdir(gguf_path) else "no such file"
        raise FileNotFoundError(f"{flag} {gguf_path!r}: {what}")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as e:  # not a GGUF file, or an architecture transformers cannot read
        raise ValueError(f"{flag} {gguf_path!r}: transformers cannot load it as a causal LM: {e}") from e
    settings = quantized.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(quantized.config).from_dict(settings)
    with no_init_weights():  # every parameter is loaded next (strict): a random init would be thrown away
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model.tie_weights()
    model.to(dtype)
    model.generation_config = GenerationConfig.from_model_config(model.config)
    repairs = repair_chat_eos(tokenizer, model.config, model.generation_config)
    stage = new_staging_dir(save_path)
    model.save_pretrained(stage)
    tokenizer.save_pretrained(stage)
    publish_staged(stage, save_path)
    return GgufImport(save_path=save_path, model_type=config.model_type, param_dtype=param_dtype,
                      num_parameters=sum(p.numel() for p in model.parameters()), eos_token=tokenizer.eos_token,
                      pad_token=tokenizer.pad_token, repairs=repairs)
