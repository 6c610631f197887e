"""Hugging Face files and names shared by the model loaders (imports only `rlhfkit.models.hub`, a
leaf): dtype names, model-directory checks (hub ids resolved to their cached snapshot), attention
implementations, the tokenizer, and the tensor names in a weight file."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from rlhfkit.config.dtypes import DTYPES
from rlhfkit.models.hub import resolve_model_path
from rlhfkit.optional import MissingPackageError

_DTYPES = {**DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# attention implementations that need an extra package, and which one
_ATTN_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
_ATTN_BUILTIN = {"eager", "sdpa", "flex_attention"}


def resolve_dtype(dtype: str | torch.dtype, flag: str = "--param_dtype") -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"{flag} must be one of bf16, fp16, fp32; got {dtype!r}")
    return _DTYPES[dtype]


def check_model_dir(path: str | None, flag: str = "--pretrain") -> str:
    """The local model directory for `path` (a directory, or a hub id resolved through the Hugging Face
    cache and, when online, the hub: `rlhfkit.models.hub`); raise naming `flag` when there is none or
    it has no config.json."""
    if not path:
        raise ValueError(f"{flag} is required (a Hugging Face model directory or hub id)")
    path = resolve_model_path(path, flag)
    if not os.path.isdir(path):
        what = "a file, not a model directory" if os.path.isfile(path) else "no such directory"
        raise FileNotFoundError(f"{flag} {path!r}: {what}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{flag} {path!r}: directory has no config.json (not a Hugging Face model)")
    return path


def check_attn_implementation(name: str, flag: str = "--attn_implementation") -> str:
    """Validate an attention implementation name; flash attention needs its package installed."""
    if name in _ATTN_PACKAGES:
        pkg = _ATTN_PACKAGES[name]
        if importlib.util.find_spec(pkg) is None:
            raise MissingPackageError(
                f"{flag} {name} needs the `{pkg}` package, which is not installed; "
                f"install it or pass {flag} sdpa")
        return name
    if name in _ATTN_BUILTIN or "/" in name:  # "org/kernel": a hub kernel, left to transformers
        return name
    raise ValueError(f"{flag} must be one of sdpa, eager, flex_attention, flash_attention_2, "
                     f"flash_attention_3; got {name!r}")


def load_tokenizer(path: str, padding_side: str = "right", chat_template: str | None = None,
                   use_fast: bool = True, flag: str = "--pretrain") -> Any:
    """Load a tokenizer; the pad token falls back to eos when the tokenizer defines none.

    `padding_side` is passed to the constructor (transformers 5 does not save it as an attribute).
    `chat_template` (--tokenizer_chat_template) replaces the tokenizer's own template.
    """
    from transformers import AutoTokenizer

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    path = check_model_dir(path, flag)
    tok = AutoTokenizer.from_pretrained(path, padding_side=padding_side, use_fast=use_fast,
                                        trust_remote_code=False)
    prepare_tokenizer(tok, padding_side, chat_template, f"tokenizer at {flag} {path!r}")
    if chat_template is None and not getattr(tok, "chat_template", None):
        tok.chat_template = _processor_chat_template(path)
    return tok


def prepare_tokenizer(tok: Any, padding_side: str, chat_template: str | None, what: str) -> Any:
    """What every tokenizer of a run gets, loaded (`load_tokenizer`) or given as an object (the Python API):
    `padding_side`, the pad token falling back to eos, and `chat_template` (--tokenizer_chat_template) in
    place of its own. Changes `tok` in place and returns it."""
    tok.padding_side = padding_side
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"{what} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _processor_chat_template(path: str) -> str | None:
    """The chat template a VLM directory keeps for its processor (chat_template.json / .jinja), or None."""
    import json

    jinja, js = os.path.join(path, "chat_template.jinja"), os.path.join(path, "chat_template.json")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    if os.path.isfile(js):
        with open(js, encoding="utf-8") as f:
            value = json.load(f).get("chat_template")
        return value if isinstance(value, str) else None
    return None


def weight_file_keys(path: str, safetensors_name: str, bin_name: str) -> set[str] | None:
    """Tensor names in `path/safetensors_name` (read from the header) or `path/bin_name`
    (loaded on the meta device); None when neither file exists."""
    st = os.path.join(path, safetensors_name)
    if os.path.isfile(st):
        from safetensors import safe_open

        with safe_open(st, framework="pt") as f:
            return set(f.keys())
    binary = os.path.join(path, bin_name)
    if os.path.isfile(binary):
        return set(torch.load(binary, map_location="meta", weights_only=True, mmap=True))
    return None


_ST_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def saved_dtype(path: str | None) -> torch.dtype | None:
    """The dtype the model directory `path` stores its weights in: its config.json's `dtype` (`torch_dtype`
    in older files), else the dtype of most floating-point values in its safetensors files (read from their
    headers); None when neither tells (no such directory, fp32 defaulted by nothing)."""
    import glob
    import json
    import struct

    if not path or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        cfg = {}
    if not isinstance(cfg, dict):
        cfg = {}
    named = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    if isinstance(named, str) and named in _DTYPES:
        return _DTYPES[named]
    sizes: dict[torch.dtype, int] = {}
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        try:
            with open(file, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            continue
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in _ST_FLOATS:
                start, end = entry.get("data_offsets", (0, 0))
                sizes[_ST_FLOATS[entry["dtype"]]] = sizes.get(_ST_FLOATS[entry["dtype"]], 0) + end - start
    return max(sizes, key=sizes.__getitem__) if sizes else None
