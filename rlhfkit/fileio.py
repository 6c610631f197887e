"""Crash-safe file writing, shared by every layer (like types.py): a reader never sees half a file.

    atomic_write_text(path, text)     <path>.tmp, fsync, os.replace, fsync the directory
                                      (run_config.json, metrics.jsonl rewrites, `latest`)
    stage = new_staging_dir(path)     <path>/.rlhfkit-staging.tmp, fresh
    ... write a Hugging Face directory into `stage` ...
    publish_staged(stage, path)       fsync every file; remove the old config.json /
                                      adapter_config.json of `path`; move the other files in;
                                      move config.json / adapter_config.json in last

Free space (`check_space`, `NoSpaceError`): a save checks the free space where it writes against the
bytes it expects to write before writing anything, and a write that still runs out of space
(`is_no_space`) is reported the same way, naming the path:

    no space left on ./ckpt/checkpoints: need 2.61 GB, have 0.734 GB

A Hugging Face directory is usually also the run directory (metrics.jsonl, run_config.json,
plots), so it cannot be swapped whole by one rename. Instead config.json (adapter_config.json for
a peft adapter), without which `from_pretrained` refuses the directory, is taken out first and put
back last: at every instant the directory either loads the complete new model or does not load
at all, never a mix of old and new files. A staging folder left by a kill is removed by the next
export.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from typing import Callable

TMP_SUFFIX = ".tmp"
GB = 2**30
STAGING = ".rlhfkit-staging" + TMP_SUFFIX
MARKERS = ("config.json", "adapter_config.json")
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?"
                          r"|adapter_model\.(safetensors|bin)")


def fsync_dir(path: str) -> None:
    """Make the entries of directory `path` (new files, renames) durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Replace `path` by `text` in one rename (the old content or the new, never a part)."""
    tmp = path + TMP_SUFFIX
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def new_staging_dir(path: str) -> str:
    """A fresh, empty `<path>/.rlhfkit-staging.tmp` (creating `path`; a killed export's leftover goes)."""
    stage = os.path.join(path, STAGING)
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    return stage


def clear_weight_files(path: str) -> None:
    """Remove the weight files (and shard index) of an earlier save, so none shadows the new set."""
    for name in os.listdir(path):
        if _WEIGHT_FILE.fullmatch(name):
            os.remove(os.path.join(path, name))


def publish_staged(stage: str, path: str, clear: Callable[[str], None] | None = clear_weight_files) -> None:
    """Move everything in `stage` into `path`, the marker files last (module docstring).

    `clear(path)` runs once the markers are out, to remove stale files the new set does not
    overwrite (by default the weight files of an earlier save, e.g. more shards than now)."""
    names = sorted(os.listdir(stage))
    markers = [n for n in MARKERS if n in names]
    for name in names:
        src = os.path.join(stage, name)
        if os.path.isfile(src):
            fsync_file(src)
    fsync_dir(stage)
    for name in markers:
        old = os.path.join(path, name)
        if os.path.isfile(old):
            os.remove(old)
    fsync_dir(path)
    if clear is not None:
        clear(path)
    for name in [n for n in names if n not in markers] + markers:
        dst = os.path.join(path, name)
        if name in markers:
            fsync_dir(path)  # every other file is in place before the directory becomes loadable
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        os.replace(os.path.join(stage, name), dst)
    fsync_dir(path)
    os.rmdir(stage)


class NoSpaceError(OSError):
    """Too little free space for a save; names the path, the bytes needed and those free."""

    def __init__(self, path: str, need: int, have: int, note: str = "") -> None:
        text = f"no space left on {path}: need {need / GB:.3g} GB, have {have / GB:.3g} GB"
        super().__init__(errno.ENOSPC, text + (f"; {note}" if note else ""))
        self.path, self.need, self.have = path, need, have

    def __str__(self) -> str:
        return str(self.strerror)


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem of `path` (its nearest existing ancestor)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_space(path: str, need: int) -> None:
    """Raise NoSpaceError when the filesystem of `path` has fewer than `need` bytes free."""
    have = free_bytes(path)
    if have < need:
        raise NoSpaceError(path, need, have)


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is a write that ran out of disk space."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def read_json_object(path: str) -> dict:
    """The JSON object in `path`; {} when the file is missing, unreadable, not JSON or not an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
