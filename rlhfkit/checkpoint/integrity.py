"""Checksums of a checkpoint: the size and SHA-256 of every file, recorded in meta.json at save time
(`checkpoint_files`, `digest_share`: each rank hashes a share) and checked before a load
(`checkpoint_damage`, `newest_intact`)."""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlhfkit.checkpoint.layout import META, read_meta

log = logging.getLogger(__name__)


HASH_CHUNK = 8 << 20


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(path: str) -> list[str]:
    """Every file of a checkpoint directory but meta.json, relative to it, sorted."""
    out = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel != META:
                out.append(rel)
    return sorted(out)


def digest_share(path: str, files: list[str], rank: int, world: int) -> dict[str, dict[str, Any]]:
    """{file: {"bytes", "sha256"}} of this rank's share of `files` (every world-th from `rank`)."""
    mine = files[rank::world]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(mine)))) as pool:
        sums = list(pool.map(lambda rel: file_sha256(os.path.join(path, rel)), mine))
    return {rel: {"bytes": os.path.getsize(os.path.join(path, rel)), "sha256": h} for rel, h in zip(mine, sums)}


def checkpoint_damage(path: str) -> str | None:
    """Which file of checkpoint `path` differs from the size and SHA-256 its meta.json records
    (None when all match, or when the checkpoint records no checksums)."""
    files = (read_meta(path) or {}).get("files")
    if not isinstance(files, dict):
        return None
    names = sorted(files)
    for rel in names:  # sizes first: cheap, and a truncation is named without reading anything
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        have, want = os.path.getsize(full), int(files[rel].get("bytes", -1))
        if have != want:
            return f"{rel} has {have} bytes, {want} were written"
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        sums = list(pool.map(lambda rel: file_sha256(os.path.join(path, rel)), names))
    for rel, h in zip(names, sums):
        if h != files[rel].get("sha256"):
            return f"{rel} does not match its checksum (its bytes were altered)"
    return None


def newest_intact(ckpt_root: str, tags: list[str]) -> tuple[str | None, list[str]]:
    """(the first of `tags` (newest first) whose checkpoint under `ckpt_root` is intact, or None;
    one line per damaged checkpoint skipped on the way, each also logged as a warning)."""
    skipped = []
    for tag in tags:
        path = os.path.join(ckpt_root, tag)
        damage = checkpoint_damage(path)
        if damage is None:
            return tag, skipped
        line = f"checkpoint {path} is damaged: {damage}; skipped"
        log.warning("%s", line)
        skipped.append(line)
    return None, skipped


def records_checksums(path: str) -> bool:
    return isinstance((read_meta(path) or {}).get("files"), dict)
