"""Rotation of the checkpoints under a root: only the `max_keep` newest (--max_ckpt_num) stay, and with
--max_ckpt_mem the oldest go while the rest hold more; a directory is renamed away (`<tag>.del.tmp`)
before it is deleted, and the `*.tmp` leftovers of killed saves are cleared before the next one."""

from __future__ import annotations

import logging
import os
import shutil

from rlhfkit.checkpoint.layout import TMP_SUFFIX, list_checkpoints
from rlhfkit.fileio import fsync_dir

log = logging.getLogger(__name__)


def _remove(path: str) -> None:
    """Delete a checkpoint directory by renaming it away first (`<name>.del.tmp`, never loaded), so
    a kill mid-delete never leaves a half-deleted directory under a checkpoint's name."""
    away = path + ".del" + TMP_SUFFIX
    shutil.rmtree(away, ignore_errors=True)
    os.replace(path, away)
    fsync_dir(os.path.dirname(path) or ".")
    shutil.rmtree(away, ignore_errors=True)


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:  # removed meanwhile
                pass
    return total


def rotate(ckpt_root: str, max_keep: int, keep_tag: str, max_gb: float | None = None) -> None:
    """Delete the oldest checkpoints beyond the `max_keep` newest (--max_ckpt_num), then, with `max_gb`
    (--max_ckpt_mem, GB as in OpenRLHF), the oldest while the checkpoints hold more than that; the one
    just saved (`keep_tag`) always stays."""
    found = [tag for _, tag in list_checkpoints(ckpt_root) if tag != keep_tag]
    while len(found) + 1 > max_keep:
        _remove(os.path.join(ckpt_root, found.pop(0)))
    if max_gb is None:
        return
    limit = max_gb * 2**30
    sizes = {tag: dir_bytes(os.path.join(ckpt_root, tag)) for tag in found + [keep_tag]}
    while found and sum(sizes.values()) > limit:
        tag = found.pop(0)
        _remove(os.path.join(ckpt_root, tag))
        log.info("removed checkpoint %s: the checkpoints held more than --max_ckpt_mem %g GB", tag, max_gb)
        del sizes[tag]
    if sum(sizes.values()) > limit:
        log.warning("checkpoint %s alone holds %.3g GB, more than --max_ckpt_mem %g GB; it is kept",
                    keep_tag, sizes[keep_tag] / 2**30, max_gb)


def clear_stale_tmp(ckpt_root: str) -> None:
    """Leftovers of killed saves, publishes and rotations (`*.tmp`): never loaded, removed here."""
    for name in os.listdir(ckpt_root):
        path = os.path.join(ckpt_root, name)
        if name.endswith(TMP_SUFFIX) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
