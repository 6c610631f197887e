"""Resumable training checkpoints: sharded (torch.distributed.checkpoint), atomic, reshardable.

Layout of `<ckpt_root>/<tag>/`:

    dcp/                  torch.distributed.checkpoint files: `.metadata` and one `__<rank>_0.distcp`
                          per rank, holding {"model": ..., "optim": ..., "ema": ... (--enable_ema)} of
                          `backend.sharded_state_dict()`:
                          each rank's DTensor shards of the fp32 weights (one process: the fp32
                          master weights) and of the AdamW state, keyed by parameter name
    trainer.pt            LR scheduler state and the fp16 loss scaler (rank 0)
    rng_<rank>.pt         python / numpy / torch CPU / CUDA generator states of each rank
    client_state.json     the caller's JSON-able state (step, data position, ...) (rank 0)
    meta.json             written last (rank 0): tag, save index, world size, format, has_optim, and
                          `files`: the size and SHA-256 of every other file of the checkpoint

Saving never gathers the model or the optimizer: every rank writes its own shards

    all ranks:  sharded_state_dict() -> dcp.save -> <tag>.tmp/dcp/  (each file fsynced)
                rng_<rank>.pt
    rank 0:     trainer.pt, client_state.json
    all ranks:  SHA-256 of a share of the files (rank r: every world_size-th file from r), gathered
    rank 0:     meta.json with the checksums (fsynced), fsync the directories,
                os.replace(<tag>.tmp, <tag>), rewrite `latest` (latest.tmp + os.replace), rotate

so a crash at any point leaves `latest` naming a complete checkpoint or lagging behind one (a kill
between the rename and its update). `<tag>.tmp` leftovers are never loaded and are removed by the
next save. A save that fails (rather than being killed) removes its `<tag>.tmp` itself and raises
an Exception: NoSpaceError naming the folder and the bytes needed when the disk filled (the caller
of a periodic save warns and trains on), else CheckpointSaveError naming the checkpoint. Both
torch.distributed.checkpoint's CheckpointException (a BaseException, wrapping each rank's failure)
and torch's own message for a short write ("unexpected pos ...", no errno) count: `is_failure`,
`root_causes`, and a disk with less than SLACK_BYTES free when the save failed.

Only the `max_keep` newest checkpoints (by save index) are kept, and with the backend's
`max_ckpt_mem` (--max_ckpt_mem, GB) the oldest go while the rest hold more; rotation renames a
directory away (`<tag>.del.tmp`) before deleting it, so a kill mid-rotation never leaves a
half-deleted directory under a checkpoint's name.

Complete (`checkpoint_gap`): meta.json, the weights (`dcp/.metadata` and every data file it names,
at least as long as the pieces it holds; or the earlier `model.safetensors`), trainer.pt,
client_state.json and `rng_<r>.pt` of every saving rank. Loading takes the newest complete
checkpoint by save index, whatever `latest` says (a lagging or wrong `latest` and incomplete
directories are logged); when checkpoint directories exist but none is complete, it is an error
naming them rather than a fresh start. Then it builds this run's `sharded_state_dict()` and lets
`dcp.load` fill it: each rank reads the pieces of its own shards from whichever files hold them,
so a checkpoint saved on N ranks loads on M ranks (resharding). A checkpoint taken before the first optimizer step has no optimizer
state; loading it resets the optimizer. Older full-state checkpoints (`model.safetensors` +
`optim.pt`, written by rank 0) still load, broadcast from rank 0. A shared filesystem is assumed.

Integrity (`checkpoint_damage`): loading checks the newest complete checkpoint's files against the
sizes and checksums in its meta.json before reading any of them. A damaged checkpoint (a file cut
short, zeroed or altered bytes, a broken zip structure in a torch file) is skipped with one line
naming it and the file, and the newest intact one is loaded instead; when none is intact, that is
the error. Checkpoints written before checksums were recorded load unverified; one that then fails
to read (any file, torch.distributed.checkpoint's CheckpointException included) is skipped the same
way, with the same line, and the next older one is loaded. One whose checksums match but which does
not load is not of this model: that is an error, with no fallback.

Trust: trainer.pt, rng_<rank>.pt and the old-format files load with `torch.load(weights_only=True)`,
but torch.distributed.checkpoint itself unpickles its `.metadata` file and non-tensor entries (the
optimizer's param_groups): load only checkpoints you wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlhfkit.parallel import dist as D
from rlhfkit.fileio import NoSpaceError, atomic_write_text, free_bytes, fsync_dir, is_no_space

log = logging.getLogger(__name__)

LATEST = "latest"
META = "meta.json"
TMP_SUFFIX = ".tmp"
DCP_DIR = "dcp"
FORMAT = "dcp-v1"


class CheckpointError(ValueError):
    """A checkpoint that does not save or load (damaged, or not of this model); the message names it,
    `reason` says what failed in a few words (for the line that skips a damaged checkpoint)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class CheckpointSaveError(CheckpointError):
    """A save that failed for a reason other than a full disk (its partial files removed); `root` is
    the folder of the checkpoints (--ckpt_path)."""

    def __init__(self, message: str, root: str) -> None:
        super().__init__(message)
        self.root = root


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint without checksums (written before they were recorded) that does not read: damaged,
    as far as anyone can tell; a caller choosing among several skips it for an older one."""


def is_failure(e: BaseException) -> bool:
    """Whether `e` is a failure of a save or load itself: any Exception, or torch.distributed.checkpoint's
    CheckpointException, which derives from BaseException; not a kill (KeyboardInterrupt, SystemExit,
    a stop signal's RunStopped), which must go through untouched."""
    if isinstance(e, Exception):
        return True
    api = sys.modules.get("torch.distributed.checkpoint.api")  # imported if DCP ran (importing it costs 2 s)
    return api is not None and isinstance(e, api.CheckpointException)


def root_causes(e: BaseException) -> list[BaseException]:
    """The exceptions a CheckpointException wraps (one per failed rank), or [e]."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    if api is not None and isinstance(e, api.CheckpointException) and e.failures:
        return [exc for exc, _ in e.failures.values()]
    return [e]


def one_line(e: BaseException, limit: int = 240) -> str:
    """`Type: first line of the message` of the first root cause of `e` (cut at `limit` characters)."""
    cause = root_causes(e)[0]
    text = str(cause).strip().splitlines()
    line = f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def last_good_checkpoint(ckpt_root: str) -> str:
    """One clause naming the newest complete checkpoint under `ckpt_root` and how to go on from it (for
    the line of a final save that could not complete)."""
    found = list_checkpoints(ckpt_root)
    if not found:
        return f"there is no complete checkpoint in {ckpt_root}"
    return (f"the last good checkpoint is {os.path.join(ckpt_root, found[-1][1])}: free space, then run the same "
            "command with --load_checkpoint to go on from it")


# ----------------------------------------------------------------------------- tensors


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


# ----------------------------------------------------------------------------- RNG


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


# ----------------------------------------------------------------------------- layout


def _write_file(path: str, data: bytes | str) -> None:
    with open(path, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_save(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _read_meta(path: str) -> dict | None:
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
    meta = _read_meta(path)
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


# ----------------------------------------------------------------------------- integrity


HASH_CHUNK = 8 << 20


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _checkpoint_files(path: str) -> list[str]:
    """Every file of a checkpoint directory but meta.json, relative to it, sorted."""
    out = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel != META:
                out.append(rel)
    return sorted(out)


def _digest_share(path: str, files: list[str], rank: int, world: int) -> dict[str, dict[str, Any]]:
    """{file: {"bytes", "sha256"}} of this rank's share of `files` (every world-th from `rank`)."""
    mine = files[rank::world]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(mine)))) as pool:
        sums = list(pool.map(lambda rel: file_sha256(os.path.join(path, rel)), mine))
    return {rel: {"bytes": os.path.getsize(os.path.join(path, rel)), "sha256": h} for rel, h in zip(mine, sums)}


def checkpoint_damage(path: str) -> str | None:
    """Which file of checkpoint `path` differs from the size and SHA-256 its meta.json records
    (None when all match, or when the checkpoint records no checksums)."""
    files = (_read_meta(path) or {}).get("files")
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
            found.append((int((_read_meta(path) or {}).get("index", 0)), name))
    return sorted(found)


def _incomplete(ckpt_root: str) -> list[tuple[str, str]]:
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
    for path, gap in _incomplete(ckpt_root):
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


def _remove(path: str) -> None:
    """Delete a checkpoint directory by renaming it away first (`<name>.del.tmp`, never loaded), so
    a kill mid-delete never leaves a half-deleted directory under a checkpoint's name."""
    away = path + ".del" + TMP_SUFFIX
    shutil.rmtree(away, ignore_errors=True)
    os.replace(path, away)
    fsync_dir(os.path.dirname(path) or ".")
    shutil.rmtree(away, ignore_errors=True)


def _dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:  # removed meanwhile
                pass
    return total


def _rotate(ckpt_root: str, max_keep: int, keep_tag: str, max_gb: float | None = None) -> None:
    """Delete the oldest checkpoints beyond the `max_keep` newest (--max_ckpt_num), then, with `max_gb`
    (--max_ckpt_mem, GB as in OpenRLHF), the oldest while the checkpoints hold more than that; the one
    just saved (`keep_tag`) always stays."""
    found = [tag for _, tag in list_checkpoints(ckpt_root) if tag != keep_tag]
    while len(found) + 1 > max_keep:
        _remove(os.path.join(ckpt_root, found.pop(0)))
    if max_gb is None:
        return
    limit = max_gb * 2**30
    sizes = {tag: _dir_bytes(os.path.join(ckpt_root, tag)) for tag in found + [keep_tag]}
    while found and sum(sizes.values()) > limit:
        tag = found.pop(0)
        _remove(os.path.join(ckpt_root, tag))
        log.info("removed checkpoint %s: the checkpoints held more than --max_ckpt_mem %g GB", tag, max_gb)
        del sizes[tag]
    if sum(sizes.values()) > limit:
        log.warning("checkpoint %s alone holds %.3g GB, more than --max_ckpt_mem %g GB; it is kept",
                    keep_tag, sizes[keep_tag] / 2**30, max_gb)


def _clear_stale_tmp(ckpt_root: str) -> None:
    """Leftovers of killed saves, publishes and rotations (`*.tmp`): never loaded, removed here."""
    for name in os.listdir(ckpt_root):
        path = os.path.join(ckpt_root, name)
        if name.endswith(TMP_SUFFIX) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- save / load


def _dcp(fn, *args: Any, **kwargs: Any) -> Any:
    """dcp.save / dcp.load, told whether there is a process group (one process: no_dist)."""
    no_dist = not D.is_distributed()
    with warnings.catch_warnings():
        if no_dist:  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, no_dist=no_dist, **kwargs)


SLACK_BYTES = 4 << 20  # RNG states, scheduler, client state and DCP metadata, at most


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors (this rank's shards) in a nested state dict."""
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    return 0


def expected_bytes(ckpt_root: str, state: dict[str, Any]) -> int:
    """What a checkpoint of `state` will take (all ranks call): its tensors on every rank, or the newest
    complete checkpoint's size if larger, plus slack for the small files."""
    need = int(D.all_reduce_sum(_tensor_bytes(state))) + SLACK_BYTES
    found = list_checkpoints(ckpt_root) if D.is_rank0() else []
    if found:
        need = max(need, _dir_bytes(os.path.join(ckpt_root, found[-1][1])))
    return need


def save_checkpoint(backend, ckpt_root: str, tag: str, client_state: dict | None,
                    max_keep: int) -> str:
    """Save model, optimizer, scheduler, RNG and `client_state` as `<ckpt_root>/<tag>` (all ranks call).

    The free space under `ckpt_root` is checked first against `expected_bytes`; too little, or a write
    that runs out of space, raises NoSpaceError (after removing this save's partial files): the
    complete checkpoints already there are untouched."""
    if max_keep < 1:
        raise ValueError(f"--max_ckpt_num must be >= 1, got {max_keep}")
    if not tag or "/" in tag or tag == LATEST or tag.endswith(TMP_SUFFIX):
        raise ValueError(f"bad checkpoint tag {tag!r}")
    try:
        client_json = json.dumps(client_state or {}, indent=2)
    except TypeError as e:
        raise TypeError(f"checkpoint client_state must be JSON-serialisable: {e}") from None
    has_optim = backend.optimizer_has_state
    state = backend.sharded_state_dict(with_optimizer=has_optim)
    need = expected_bytes(ckpt_root, state)
    free = D.broadcast_object(free_bytes(ckpt_root) if D.is_rank0() else 0)  # every rank stops together
    if free < need:
        raise NoSpaceError(ckpt_root, need, free)
    tmp = os.path.join(ckpt_root, tag + TMP_SUFFIX)
    try:
        return _write_checkpoint(backend, ckpt_root, tag, state, has_optim, client_json, max_keep)
    except BaseException as e:
        if not is_failure(e):
            raise  # a kill: the `.tmp` stays, never loaded, removed by the next save
        raise _save_failure(e, ckpt_root, tmp, need) from e


def _save_failure(e: BaseException, ckpt_root: str, tmp: str, need: int) -> Exception:
    """Remove a failed save's partial files (`tmp`) and say what it was: NoSpaceError when the disk
    filled (ENOSPC or EDQUOT in any rank's failure, or torch's own message for a short write, such as
    "unexpected pos 704 vs 598", while less than SLACK_BYTES are free), else CheckpointSaveError naming
    the checkpoint and the first failure. Both are Exceptions, whereas torch.distributed.checkpoint
    raises a BaseException, which would pass through every handler to a traceback."""
    at_failure = free_bytes(ckpt_root)  # before the partial files go: what the write ran into
    if D.is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
    have = free_bytes(ckpt_root)
    if any(is_no_space(c) for c in root_causes(e)) or at_failure < SLACK_BYTES or have < need:
        note = "the disk filled during the write; its partial files are removed" if have >= need else ""
        return NoSpaceError(ckpt_root, need, min(at_failure, have), note=note)
    return CheckpointSaveError(f"checkpoint {tmp.removesuffix(TMP_SUFFIX)} was not saved ({one_line(e)}); its "
                               "partial files are removed", root=ckpt_root)


def _write_checkpoint(backend, ckpt_root: str, tag: str, state: dict[str, Any], has_optim: bool, client_json: str,
                      max_keep: int) -> str:
    import torch.distributed.checkpoint as dcp

    tmp, final = os.path.join(ckpt_root, tag + TMP_SUFFIX), os.path.join(ckpt_root, tag)
    rank0 = D.is_rank0()
    if rank0:
        if not os.path.isdir(ckpt_root):
            os.makedirs(ckpt_root)
            fsync_dir(os.path.dirname(os.path.abspath(ckpt_root)))
        _clear_stale_tmp(ckpt_root)
        os.makedirs(os.path.join(tmp, DCP_DIR))
    D.barrier()
    has_ema = "ema" in state
    writer = dcp.FileSystemWriter(os.path.join(tmp, DCP_DIR), sync_files=True)
    _dcp(dcp.save, state, storage_writer=writer)
    del state
    _torch_save(rng_state(), os.path.join(tmp, f"rng_{D.get_rank()}.pt"))
    if rank0:
        _torch_save(backend.trainer_state(), os.path.join(tmp, "trainer.pt"))
        _write_file(os.path.join(tmp, "client_state.json"), client_json)
    D.barrier()
    files = D.broadcast_object(_checkpoint_files(tmp) if rank0 else None)
    shares = D.all_gather_object(_digest_share(tmp, files, D.get_rank(), D.get_world_size()))
    if rank0:
        index = max([i for i, _ in list_checkpoints(ckpt_root)], default=-1) + 1
        meta = {"tag": tag, "index": index, "world_size": D.get_world_size(), "time": time.time(),
                "format": FORMAT, "has_optim": has_optim, "has_ema": has_ema,
                "files": {k: v for share in shares for k, v in sorted(share.items())}}
        _write_file(os.path.join(tmp, META), json.dumps(meta))
        fsync_dir(os.path.join(tmp, DCP_DIR))
        fsync_dir(tmp)
        _publish(ckpt_root, tag, tmp, final)
        max_gb = getattr(getattr(backend, "cfg", None), "max_ckpt_mem", None)  # --max_ckpt_mem
        _rotate(ckpt_root, max_keep, keep_tag=tag, max_gb=max_gb)
    D.barrier()
    return final


def _publish(ckpt_root: str, tag: str, tmp: str, final: str) -> None:
    """Move the finished `<tag>.tmp` into place, then point `latest` at it."""
    old = None
    if os.path.exists(final):
        old = final + ".old" + TMP_SUFFIX
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    atomic_write_text(os.path.join(ckpt_root, LATEST), tag)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _load_sharded(backend, path: str, meta: dict) -> None:
    """dcp.load into this run's own shards (any world size), then hand them to the backend."""
    import torch.distributed.checkpoint as dcp

    state = backend.sharded_state_dict(with_optimizer=bool(meta.get("has_optim", True)),
                                       with_ema=bool(meta.get("has_ema", False)))
    try:
        _dcp(dcp.load, state, storage_reader=dcp.FileSystemReader(os.path.join(path, DCP_DIR)))
    except BaseException as e:  # DCP wraps per-rank failures in a BaseException; name the checkpoint
        if not is_failure(e):
            raise
        raise CheckpointError(f"--load_checkpoint: {path} does not match this model and optimizer (saved on "
                              f"{meta.get('world_size')} ranks): {one_line(e)}",
                              reason=f"{DCP_DIR}/ does not load ({one_line(e)})") from e
    backend.load_sharded_state_dict(state)


def _load_full_state(backend, path: str) -> None:
    """Checkpoints of the earlier format: full state written by rank 0, broadcast when sharded."""
    load_here = D.is_rank0() or not backend.is_sharded
    model_sd: dict = {}
    optim_sd: dict = {}
    error = None
    if load_here:
        try:
            model_sd = load_tensors(os.path.join(path, "model.safetensors"))
            optim_sd = torch.load(os.path.join(path, "optim.pt"), weights_only=True)
        except Exception as e:  # noqa: BLE001 - safetensors, zip or pickle damage, whatever the exception
            why = f"model.safetensors or optim.pt does not read ({one_line(e)})"
            error = CheckpointError(f"--load_checkpoint: {path}: {why}", reason=why)
    if D.all_reduce_sum(int(error is not None)):  # rank 0 broadcasts: every rank stops together
        raise error or CheckpointError(f"--load_checkpoint: {path} did not read on rank 0", reason="unreadable")
    backend.load_full_state(model_sd, optim_sd)


def _load_candidates(ckpt_root: str, tag: str | None) -> tuple[list[str], str | None]:
    """(the complete checkpoints to try, newest first, or `tag`; error): checkpoint directories that are
    all incomplete, or an incomplete `tag`, are an error rather than a silent fresh start."""
    if tag is not None:
        path = os.path.join(ckpt_root, tag)
        gap = checkpoint_gap(path)
        return ([path], None) if gap is None else ([], f"--load_checkpoint: {path}: {gap}")
    if latest_checkpoint(ckpt_root) is None:
        bad = _incomplete(ckpt_root)
        if bad:
            return [], "--load_checkpoint: no complete checkpoint in {}: {}".format(
                ckpt_root, "; ".join(f"{p}: {gap}" for p, gap in bad))
        return [], None
    return [os.path.join(ckpt_root, t) for _, t in reversed(list_checkpoints(ckpt_root))], None


def load_checkpoint(backend, ckpt_root: str, tag: str | None = None) -> dict | None:
    """Restore the newest complete and intact checkpoint (or `tag`) into `backend`; its client state, or
    None if there is none.

    Intact: its files match the checksums its meta.json records, checked before reading (module
    docstring). A checkpoint written before checksums were recorded is known damaged only when it
    fails to read; it is then skipped the same way (with `tag`: UnreadableCheckpointError, so that a
    caller choosing among tags can go on to an older one), and the next older one is loaded (each
    attempt replaces every tensor, optimizer state, RNG and the trainer's state). A checkpoint whose
    checksums match but which does not load is not of this model: an error, with no fallback."""
    plan = _load_candidates(ckpt_root, tag) if D.is_rank0() else None
    paths, error = D.broadcast_object(plan)
    if error:
        raise FileNotFoundError(error)
    skipped: list[str] = []
    for path in paths:
        damage = D.broadcast_object(checkpoint_damage(path) if D.is_rank0() else None)
        if damage is None:
            client, failure = _attempt(backend, path)
            if failure is None:
                return client
            if _records_checksums(path):
                raise failure
            damage = f"{failure.reason} (it records no checksums: written before they were)"
        line = f"checkpoint {path} is damaged: {damage}; skipped"
        if tag is not None:
            if _records_checksums(path):
                raise FileNotFoundError(f"--load_checkpoint: {path}: {damage}")
            raise UnreadableCheckpointError(f"--load_checkpoint: {line.removesuffix('; skipped')}", reason=damage)
        log.warning("%s", line)
        skipped.append(line)
    if not paths:
        return None
    raise FileNotFoundError(f"--load_checkpoint: no intact checkpoint in {ckpt_root}: " + "; ".join(skipped))


def _records_checksums(path: str) -> bool:
    return isinstance((_read_meta(path) or {}).get("files"), dict)


def _attempt(backend, path: str) -> tuple[Any, CheckpointError | None]:
    """(client state, None) after loading checkpoint `path` into `backend`, or (None, why it did not load);
    every rank takes the same way."""
    try:
        client, failure = _load_into(backend, path), None
    except CheckpointError as e:
        client, failure = None, e
    if D.all_reduce_sum(int(failure is not None)):
        return None, failure or CheckpointError(f"--load_checkpoint: {path} did not load on another rank",
                                                reason="it did not load on another rank")
    D.barrier()
    return client, None


def _load_into(backend, path: str) -> Any:
    """Weights, optimizer, trainer state and RNG of checkpoint `path` into `backend`; its client state."""
    meta = _read_meta(path) or {}
    if os.path.isdir(os.path.join(path, DCP_DIR)):
        _load_sharded(backend, path, meta)
    else:
        _load_full_state(backend, path)
    backend.load_trainer_state(_load_file(path, "trainer.pt"))
    rng_name = f"rng_{D.get_rank()}.pt"
    if not os.path.exists(os.path.join(path, rng_name)):
        log.warning("%s has no RNG state for rank %d; using rank 0's", path, D.get_rank())
        rng_name = "rng_0.pt"
    set_rng_state(_load_file(path, rng_name))
    return _load_file(path, "client_state.json")


def _load_file(path: str, name: str) -> Any:
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
