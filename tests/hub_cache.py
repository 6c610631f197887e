"""Put a local model directory into a Hugging Face hub cache the way huggingface_hub lays it out
(importable as `hub_cache`: tests/ is on sys.path through its conftest):

    <cache>/models--<org>--<name>/blobs/<sha256 of the file>
    <cache>/models--<org>--<name>/snapshots/<commit>/<file>  -> ../../blobs/<sha256>  (symlinks)
    <cache>/models--<org>--<name>/refs/main                  <commit>
"""

from __future__ import annotations

import hashlib
import os


def place_in_hub_cache(model_dir: str, cache: str, repo_id: str, commit: str = "a" * 40,
                       only: tuple[str, ...] | None = None) -> str:
    """Copy the files of `model_dir` (or only those named in `only`) into `cache` as `repo_id`;
    returns the snapshot folder."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    blobs, snapshot = os.path.join(repo, "blobs"), os.path.join(repo, "snapshots", commit)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for name in sorted(os.listdir(model_dir)):
        src = os.path.join(model_dir, name)
        if not os.path.isfile(src) or (only is not None and name not in only):
            continue
        with open(src, "rb") as f:
            data = f.read()
        sha = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, sha), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", sha), os.path.join(snapshot, name))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    return snapshot
