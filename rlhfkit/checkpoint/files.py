"""The files of a checkpoint: safetensors of a state dict (shared tensors stored once, as aliases), the
generator states of a rank (loadable with weights_only=True), fsynced writes, and the reading of one small file
(torch or JSON) with an error naming the checkpoint and the file."""

from __future__ import annotations

import json
import logging
import os
import random
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlhfkit.checkpoint.errors import CheckpointError, one_line

log = logging.getLogger(__name__)


def save_tensors(path: str, sd: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """safetensors file of `sd`; tensors sharing memory are stored once and recorded as aliases."""
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_view: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in sd.items():
        t = t.detach()
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in by_view:
            aliases[name] = by_view[key]
            continue
        by_view[key] = name
        sptr = t.untyped_storage().data_ptr()
        t = t.contiguous()
        if t.numel() and sptr in storages:
            t = t.clone()
        storages.add(sptr)
        out[name] = t.cpu()
    meta = dict(metadata or {})
    meta["rlhfkit_aliases"] = json.dumps(aliases)
    save_file(out, path, metadata=meta)


def load_tensors(path: str) -> dict[str, torch.Tensor]:
    """Inverse of `save_tensors` (aliases restored as the same tensor)."""
    from safetensors import safe_open

    sd = load_file(path)
    with safe_open(path, framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("rlhfkit_aliases", "{}"))
    for name, target in aliases.items():
        sd[name] = sd[target]
    return sd


def rng_state() -> dict[str, Any]:
    """Generator states as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("checkpoint has %d CUDA generator states, this host has %d GPUs: not restored",
                        len(cuda), torch.cuda.device_count())


def write_file(path: str, data: bytes | str) -> None:
    with open(path, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def torch_save(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def load_checkpoint_file(path: str, name: str) -> Any:
    """torch.load (weights only) or json.load of one file of checkpoint `path`; a file that does not
    read is an error naming the checkpoint and the file."""
    full = os.path.join(path, name)
    try:
        if name.endswith(".json"):
            with open(full) as f:
                return json.load(f)
        return torch.load(full, weights_only=True)
    except Exception as e:  # noqa: BLE001 - zip, pickle or JSON damage, whatever the exception
        why = f"{name} does not read ({one_line(e)})"
        raise CheckpointError(f"--load_checkpoint: {full} of checkpoint {path} does not read "
                              f"({type(e).__name__}: {e})", reason=why) from e
