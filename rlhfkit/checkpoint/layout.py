"""Layout of a checkpoint folder (sharded.py's docstring): the names it uses, when a checkpoint
directory is complete (`checkpoint_gap`), the complete ones under a root by save index
(`list_checkpoints`) and the newest of them whatever `latest` says (`latest_checkpoint`)."""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger(__name__)

LATEST = "latest"
META = "meta.json"
TMP_SUFFIX = ".tmp"
DCP_DIR = "dcp"
FORMAT = "dcp-v1"


def read_meta(path: str) -> dict | None:
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _dcp_gap(dcp_dir: str) -> str | None:
    """What is missing from a torch.distributed.checkpoint folder: its `.metadata`, or a data file
    it names (or that file is shorter than the pieces it must hold); None when all is there."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(dcp_dir).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - missing or truncated .metadata, whatever the exception
        return f"{DCP_DIR}/.metadata is unreadable ({type(e).__name__})"
    need: dict[str, int] = {}
    for info in (storage or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        try:
            have = os.path.getsize(os.path.join(dcp_dir, name))
        except OSError:
            return f"{DCP_DIR}/{name} is missing"
        if have < size:
            return f"{DCP_DIR}/{name} has {have} of {size} bytes"
    return None


def checkpoint_gap(path: str) -> str | None:
    """Why `path` is not a complete checkpoint (None when it is): meta.json, the weights (sharded
    `dcp/` or the earlier `model.safetensors`), trainer.pt, client_state.json and every rank's RNG."""
    meta = read_meta(path)
    if meta is None:
        return f"no readable {META}"
    if os.path.isdir(os.path.join(path, DCP_DIR)):
        gap = _dcp_gap(os.path.join(path, DCP_DIR))
        if gap:
            return gap
    elif not os.path.isfile(os.path.join(path, "model.safetensors")):
        return f"has neither {DCP_DIR}/ (sharded checkpoint) nor model.safetensors (full-state checkpoint)"
    ranks = int(meta.get("world_size", 1) or 1)
    for name in ("trainer.pt", "client_state.json", *(f"rng_{r}.pt" for r in range(ranks))):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    return None


def _candidates(ckpt_root: str) -> list[str]:
    """Directories under `ckpt_root` that look like checkpoints (a meta.json, no `.tmp` suffix)."""
    if not os.path.isdir(ckpt_root):
        return []
    return sorted(name for name in os.listdir(ckpt_root)
                  if not name.endswith(TMP_SUFFIX) and os.path.isfile(os.path.join(ckpt_root, name, META)))


def list_checkpoints(ckpt_root: str) -> list[tuple[int, str]]:
    """(save index, tag) of every complete checkpoint under `ckpt_root`, oldest first."""
    found = []
    for name in _candidates(ckpt_root):
        path = os.path.join(ckpt_root, name)
        if checkpoint_gap(path) is None:
            found.append((int((read_meta(path) or {}).get("index", 0)), name))
    return sorted(found)


def incomplete_checkpoints(ckpt_root: str) -> list[tuple[str, str]]:
    """(path, what is missing) of the checkpoint-looking directories that are not complete."""
    out = []
    for name in _candidates(ckpt_root):
        gap = checkpoint_gap(os.path.join(ckpt_root, name))
        if gap is not None:
            out.append((os.path.join(ckpt_root, name), gap))
    return out


def latest_checkpoint(ckpt_root: str) -> str | None:
    """Path of the newest complete checkpoint (by save index), whatever `latest` says; else None.

    `latest` may lag (a kill between the rename and its update) or name a checkpoint that a kill
    mid-rotation left half deleted: both are logged, neither is followed."""
    found = list_checkpoints(ckpt_root)
    for path, gap in incomplete_checkpoints(ckpt_root):
        log.warning("%s is not a complete checkpoint (%s): not loaded", path, gap)
    if not found:
        return None
    newest = found[-1][1]
    try:
        with open(os.path.join(ckpt_root, LATEST)) as f:
            tag = f.read().strip()
    except OSError:
        tag = ""
    if tag != newest:
        log.warning("%s/latest names %r; the newest complete checkpoint is %r: loading that",
                    ckpt_root, tag, newest)
    return os.path.join(ckpt_root, newest)


def last_good_checkpoint(ckpt_root: str) -> str:
    """One clause naming the newest complete checkpoint under `ckpt_root` and how to go on from it (for
    the line of a final save that could not complete)."""
    found = list_checkpoints(ckpt_root)
    if not found:
        return f"there is no complete checkpoint in {ckpt_root}"
    return (f"the last good checkpoint is {os.path.join(ckpt_root, found[-1][1])}: free space, then run the same "
            "command with --load_checkpoint to go on from it")
