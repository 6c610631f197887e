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

This module holds the save and load through torch.distributed.checkpoint; beside it: errors.py (what a failed
save or load raises), files.py (safetensors with aliases, RNG states, fsynced writes, reading one file),
layout.py (names, completeness, listing, `latest`), integrity.py (checksums) and rotation.py (--max_ckpt_num,
--max_ckpt_mem, leftovers of killed saves).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from typing import Any

import torch

from rlhfkit.checkpoint.errors import (CheckpointError, CheckpointSaveError, UnreadableCheckpointError, is_failure,
                                       one_line, root_causes)
from rlhfkit.checkpoint.files import load_checkpoint_file, load_tensors, rng_state, set_rng_state, torch_save, write_file
from rlhfkit.checkpoint.integrity import checkpoint_damage, checkpoint_files, digest_share, records_checksums
from rlhfkit.checkpoint.layout import (DCP_DIR, FORMAT, LATEST, META, TMP_SUFFIX, checkpoint_gap, incomplete_checkpoints,
                                       latest_checkpoint, list_checkpoints, read_meta)
from rlhfkit.checkpoint.rotation import clear_stale_tmp, dir_bytes, rotate
from rlhfkit.fileio import NoSpaceError, atomic_write_text, free_bytes, fsync_dir, is_no_space
from rlhfkit.parallel import dist as D

log = logging.getLogger(__name__)


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
        need = max(need, dir_bytes(os.path.join(ckpt_root, found[-1][1])))
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
        clear_stale_tmp(ckpt_root)
        os.makedirs(os.path.join(tmp, DCP_DIR))
    D.barrier()
    has_ema = "ema" in state
    writer = dcp.FileSystemWriter(os.path.join(tmp, DCP_DIR), sync_files=True)
    _dcp(dcp.save, state, storage_writer=writer)
    del state
    torch_save(rng_state(), os.path.join(tmp, f"rng_{D.get_rank()}.pt"))
    if rank0:
        torch_save(backend.trainer_state(), os.path.join(tmp, "trainer.pt"))
        write_file(os.path.join(tmp, "client_state.json"), client_json)
    D.barrier()
    files = D.broadcast_object(checkpoint_files(tmp) if rank0 else None)
    shares = D.all_gather_object(digest_share(tmp, files, D.get_rank(), D.get_world_size()))
    if rank0:
        index = max([i for i, _ in list_checkpoints(ckpt_root)], default=-1) + 1
        meta = {"tag": tag, "index": index, "world_size": D.get_world_size(), "time": time.time(),
                "format": FORMAT, "has_optim": has_optim, "has_ema": has_ema,
                "files": {k: v for share in shares for k, v in sorted(share.items())}}
        write_file(os.path.join(tmp, META), json.dumps(meta))
        fsync_dir(os.path.join(tmp, DCP_DIR))
        fsync_dir(tmp)
        _publish(ckpt_root, tag, tmp, final)
        max_gb = getattr(getattr(backend, "cfg", None), "max_ckpt_mem", None)  # --max_ckpt_mem
        rotate(ckpt_root, max_keep, keep_tag=tag, max_gb=max_gb)
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
        bad = incomplete_checkpoints(ckpt_root)
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
            if records_checksums(path):
                raise failure
            damage = f"{failure.reason} (it records no checksums: written before they were)"
        line = f"checkpoint {path} is damaged: {damage}; skipped"
        if tag is not None:
            if records_checksums(path):
                raise FileNotFoundError(f"--load_checkpoint: {path}: {damage}")
            raise UnreadableCheckpointError(f"--load_checkpoint: {line.removesuffix('; skipped')}", reason=damage)
        log.warning("%s", line)
        skipped.append(line)
    if not paths:
        return None
    raise FileNotFoundError(f"--load_checkpoint: no intact checkpoint in {ckpt_root}: " + "; ".join(skipped))


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
    meta = read_meta(path) or {}
    if os.path.isdir(os.path.join(path, DCP_DIR)):
        _load_sharded(backend, path, meta)
    else:
        _load_full_state(backend, path)
    backend.load_trainer_state(load_checkpoint_file(path, "trainer.pt"))
    rng_name = f"rng_{D.get_rank()}.pt"
    if not os.path.exists(os.path.join(path, rng_name)):
        log.warning("%s has no RNG state for rank %d; using rank 0's", path, D.get_rank())
        rng_name = "rng_0.pt"
    set_rng_state(load_checkpoint_file(path, rng_name))
    return load_checkpoint_file(path, "client_state.json")
