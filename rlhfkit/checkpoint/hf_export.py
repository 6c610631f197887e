"""Hugging Face export that streams: one full tensor at a time into size-capped safetensors files.

    plan (every rank, no communication): the module's state dict in order, tied tensors once,
      each entry's global shape and export dtype -> files of at most `max_shard_bytes`
      (a larger tensor gets a file of its own), each file's safetensors header
    rank 0: clear stale weight files, write each file's header
    for each planned tensor, in plan order:
      every rank:  full = tensor.full_tensor()        (DTensor: all-gather over its mesh)
      rank 0:      cast to `dtype`, append its bytes to the current file, drop it
    rank 0: model.safetensors.index.json (when several files), config.json (dtype,
      architectures), generation_config.json, tokenizer files, and a vision-language model's image
      processor files, copied from the tokenizer's source directory
    rank 0: all of it was written into `<path>/.rlhfkit-staging.tmp`; publish it into `path`
      (rlhfkit.fileio: fsync, config.json out first and in last, so a kill never leaves a
      directory that loads a mix of old and new files)

Because the header of a safetensors file only needs names, dtypes and shapes, it is written
before any tensor is gathered, and rank 0 holds one full tensor in host memory at a time: a 32B
model is exported from hosts with less memory than the model. Files and index follow
`PreTrainedModel.save_pretrained`: one file is `model.safetensors` (no index); N files are
`model-0000k-of-0000N.safetensors` plus `model.safetensors.index.json`, whose `weight_map`
names every tensor. Tied tensors (e.g. `lm_head.weight` = `model.embed_tokens.weight`) are
stored once under the name `from_pretrained` does not re-tie.

Not streamed (they fall back to one gathered state dict and `save_pretrained`): peft models
(only the adapter is written; peft selects it from the full state dict) and models whose
transformers class converts weights on load (`revert_weight_conversion` is not the identity,
e.g. fused MoE experts), since such a conversion may need several tensors at once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from rlhfkit.parallel import dist as D
from rlhfkit.parallel.sharding import full
from rlhfkit.fileio import (STAGING, NoSpaceError, clear_weight_files, free_bytes, is_no_space, new_staging_dir,
                            publish_staged)

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


def parse_size(size: int | str) -> int:
    """Bytes of --hf_max_shard_size: an int, or "5GB" / "500MB" (powers of 10) / "2GiB" (powers of 2)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
        if m is None:
            raise ValueError(f"--hf_max_shard_size must be bytes or a size like 5GB, 500MB or 2GiB, got {size!r}")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"--hf_max_shard_size must be > 0, got {size!r}")
    return value


# ----------------------------------------------------------------------------- plan


@dataclass
class ExportTensor:
    """One tensor of the export: its HF name, the module's tensor (maybe a DTensor shard), and
    the global shape and dtype it is written with."""

    name: str
    source: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def export_tensors(model: nn.Module, dtype: torch.dtype,
                   master_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> list[ExportTensor]:
    """The module's state dict as ExportTensors (no data touched): floating tensors in `dtype`,
    tied tensors once, an fp32 master (one-process master weights) in place of its parameter."""
    sd = model.state_dict(keep_vars=True)
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    names_of: dict[int, list[str]] = {}
    for name, t in sd.items():
        names_of.setdefault(id(t), []).append(name)
    keep = set()
    for names in names_of.values():
        untied = [n for n in names if n not in tied_targets]
        keep.add((untied or names)[0])
    out = []
    for name, t in sd.items():
        if name not in keep:
            continue
        src = (master_of(t) if master_of is not None else None)
        src = (src if src is not None else t).detach()
        out.append(ExportTensor(name, src, tuple(src.shape),
                                dtype if src.is_floating_point() else src.dtype))
    return out


def plan_files(tensors: list[ExportTensor], max_bytes: int) -> list[list[ExportTensor]]:
    """Consecutive groups of at most `max_bytes` each (a larger tensor is a group of its own)."""
    files: list[list[ExportTensor]] = []
    size = 0
    for t in tensors:
        if not files or (files[-1] and size + t.nbytes > max_bytes):
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files or [[]]


def file_names(n: int) -> list[str]:
    return [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def safetensors_header(tensors: list[ExportTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus JSON header of a safetensors file holding `tensors` in this order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for t in tensors:
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{t.name}: dtype {t.dtype} cannot be stored in safetensors")
        header[t.name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


# ----------------------------------------------------------------------------- writing


def _write_tensor(f, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    if t.numel():
        f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def write_streamed(tensors: list[ExportTensor], path: str, max_bytes: int) -> list[str]:
    """All ranks call (in the same order each gathers every tensor); rank 0 writes the files.
    Returns the file names."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors export needs a little-endian host")
    files = plan_files(tensors, max_bytes)
    names = file_names(len(files))
    writer = D.is_rank0()
    if writer:
        os.makedirs(path, exist_ok=True)
        clear_weight_files(path)
    for group, fname in zip(files, names):
        f = open(os.path.join(path, fname), "wb") if writer else None
        try:
            if f is not None:
                f.write(safetensors_header(group))
            for t in group:
                value = full(t.source)  # collective for DTensors: every rank gathers
                if f is not None:
                    _write_tensor(f, value.to(t.dtype))
                del value
        finally:
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
    if writer and len(names) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: fname for group, fname in zip(files, names) for t in group}}
        with open(os.path.join(path, INDEX_NAME), "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)
            fh.write("\n")
    return names


def _needs_weight_conversion(model: nn.Module, tensors: list[ExportTensor]) -> bool:
    """True when transformers would rename or reshape these weights on save (checked on meta tensors)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return False
    meta = {t.name: torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors}
    try:
        back = revert_weight_conversion(model, dict(meta))
    except Exception:  # noqa: BLE001 - any failure means we cannot stream safely
        return True
    return back.keys() != meta.keys() or any(tuple(back[k].shape) != tuple(meta[k].shape) for k in meta)


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def write_config(model: nn.Module, path: str, dtype: torch.dtype) -> None:
    """config.json (with the saved dtype and the architecture) and generation_config.json."""
    model.config.save_pretrained(path)
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["architectures"] = [type(model).__name__.removeprefix("FSDP")]
    set_config_dtype(cfg, dtype)
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        gen.save_pretrained(path)


def set_config_dtype(cfg: dict, dtype: torch.dtype) -> None:
    name = str(dtype).replace("torch.", "")
    for key in ("dtype", "torch_dtype"):
        if key in cfg or key == "dtype":
            cfg[key] = name


def _save_gathered(model: nn.Module, path: str, dtype: torch.dtype, max_bytes: int,
                   full_state_dict: Callable[[], dict[str, torch.Tensor]]) -> None:
    """The non-streamed fallback: one full CPU state dict on rank 0, then `save_pretrained`."""
    sd = full_state_dict()
    if D.is_rank0():
        sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
        model.save_pretrained(path, state_dict=sd, safe_serialization=True, max_shard_size=max_bytes)
        cfg_file = os.path.join(path, "config.json")
        if os.path.isfile(cfg_file):  # a peft adapter directory has adapter_config.json only
            with open(cfg_file) as f:
                cfg = json.load(f)
            set_config_dtype(cfg, dtype)
            with open(cfg_file, "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)


def export_hf(model: nn.Module, path: str, dtype: torch.dtype, max_shard_bytes: int, tokenizer: Any = None,
              master_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
              full_state_dict: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
    """Write `model` as a Hugging Face directory at `path` (all ranks call; rank 0 writes).

    Rank 0 writes into a staging folder and publishes it (`rlhfkit.fileio`): `path` loads either
    the complete new model or nothing, never a mix of old and new files.
    master_of: the fp32 master of a module tensor, if any (one-process master weights).
    full_state_dict: gathers the full state dict, for the non-streamed fallback (module docstring).
    """
    tensors = export_tensors(model, dtype, master_of)
    writer = D.is_rank0()
    need = export_bytes(model, tensors, dtype)
    have = D.broadcast_object(free_bytes(path) if writer else 0)  # every rank stops together
    if have < need:
        raise NoSpaceError(path, need, have)
    try:
        _export(model, path, dtype, max_shard_bytes, tokenizer, tensors, full_state_dict)
    except Exception as e:
        if writer:
            shutil.rmtree(os.path.join(path, STAGING), ignore_errors=True)  # this export's partial files
        have = free_bytes(path)
        if is_no_space(e) or have < need:
            raise NoSpaceError(path, need, have) from e
        raise
    D.barrier()


EXPORT_SLACK_BYTES = 16 << 20  # config, generation config, tokenizer files


def export_bytes(model: nn.Module, tensors: list["ExportTensor"], dtype: torch.dtype) -> int:
    """What the export writes: every tensor (a peft model: its trainable adapter weights), plus slack."""
    if _is_peft(model):
        size = sum(p.numel() for p in model.parameters() if p.requires_grad) * dtype.itemsize
    else:
        size = sum(t.nbytes for t in tensors)
    return size + EXPORT_SLACK_BYTES


def _export(model: nn.Module, path: str, dtype: torch.dtype, max_shard_bytes: int, tokenizer: Any,
            tensors: list["ExportTensor"], full_state_dict: Callable[[], dict[str, torch.Tensor]] | None) -> None:
    writer = D.is_rank0()
    stage = new_staging_dir(path) if writer else path  # other ranks only take part in the gathers
    if _is_peft(model) or _needs_weight_conversion(model, tensors):
        if full_state_dict is None:
            raise ValueError("this model cannot be exported tensor by tensor and no full_state_dict was given")
        log.warning("HF export of %s is not streamed (peft adapter or converted weights): "
                    "the full state dict is gathered on rank 0", type(model).__name__)
        _save_gathered(model, stage, dtype, max_shard_bytes, full_state_dict)
    else:
        write_streamed(tensors, stage, max_shard_bytes)
        if writer:
            write_config(model, stage, dtype)
    if writer:
        if tokenizer is not None:
            tokenizer.save_pretrained(stage)
            copy_processor_files(getattr(tokenizer, "name_or_path", None), stage)
        publish_staged(stage, path)


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


def copy_processor_files(src: str | None, dst: str) -> list[str]:
    """Copy a VLM's image / video processor configs from the source model directory `src` (what the
    tokenizer was loaded from) to `dst`, so the export loads with `AutoProcessor` too."""
    import shutil

    if not src or not os.path.isdir(src) or os.path.abspath(src) == os.path.abspath(dst):
        return []
    done = []
    for name in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(src, name)) and not os.path.exists(os.path.join(dst, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
            done.append(name)
    return done
