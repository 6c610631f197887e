"""Checkpoint saves and loads that fail: a disk filling during the write (ENOSPC inside
torch.distributed.checkpoint, whose CheckpointException is a BaseException; torch's "unexpected pos"
short write) is a NoSpaceError naming the folder, with the partial files removed; another failure is
one CheckpointSaveError naming the checkpoint; a checkpoint written before checksums were recorded
that does not read is skipped for the one before, as a damaged checkpoint with checksums is."""

from __future__ import annotations

import errno
import json
import logging
import os
import re

import pytest
import torch

from rlhfkit.checkpoint import sharded as ckpt
from rlhfkit.checkpoint.errors import CheckpointSaveError
from rlhfkit.checkpoint.layout import list_checkpoints
from rlhfkit.fileio import GB, NoSpaceError

from dcp_faults import fill_dcp_writes
from test_backend_checkpoint import batches, new_backend, train, weights
from test_checkpoint_integrity import break_zip


@pytest.fixture()
def one(tiny_model_dir, tmp_path):
    """A backend with checkpoint s1 under `root`, trained one step further; its weights at s1."""
    root = str(tmp_path / "ck")
    b = new_backend(tiny_model_dir)
    data = batches(b.model.config.vocab_size, 2)
    train(b, data[:1])
    b.save_checkpoint(root, "s1", {"step": 1}, max_keep=3)
    at_s1 = weights(b)
    train(b, data[1:])
    return root, b, at_s1


def assert_only_s1(root: str) -> None:
    assert sorted(os.listdir(root)) == ["latest", "s1"]  # no s2.tmp left behind
    assert open(os.path.join(root, "latest")).read().strip() == "s1"


def test_enospc_inside_the_dcp_write_is_no_space_error_and_removes_the_partial_files(one, monkeypatch):
    root, b, _ = one
    with monkeypatch.context() as m:
        fill_dcp_writes(m)
        with pytest.raises(NoSpaceError) as e:
            b.save_checkpoint(root, "s2", {"step": 2}, max_keep=3)
    assert isinstance(e.value, Exception)  # not torch's CheckpointException, which no `except Exception` catches
    assert str(e.value).startswith(f"no space left on {root}: need ") and " GB, have " in str(e.value)
    assert e.value.need > 1e6  # the tiny model's fp32 weights and AdamW moments: some MB
    assert_only_s1(root)
    b.save_checkpoint(root, "s2", {"step": 2}, max_keep=3)  # with room again, the next save goes through
    assert [t for _, t in list_checkpoints(root)] == ["s1", "s2"]


def test_a_short_write_without_errno_on_a_full_disk_is_no_space_error(one, monkeypatch):
    """torch's zip writer reports a short write as "unexpected pos 704 vs 598", no errno: what counts is that
    the disk is full when the save fails."""
    root, b, _ = one
    free = iter([10 * GB, 0, 10 * GB])  # the check before the save, at the failure, after the cleanup
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: next(free))
    real = ckpt.torch_save

    def short_write(obj, path):
        if path.endswith("trainer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        real(obj, path)

    monkeypatch.setattr(ckpt, "torch_save", short_write)
    with pytest.raises(NoSpaceError, match=rf"^no space left on {root}: need [0-9.e-]+ GB, have 0 GB; the disk "
                                           "filled during the write; its partial files are removed$"):
        b.save_checkpoint(root, "s2", {"step": 2}, max_keep=3)
    assert_only_s1(root)


def test_another_failure_inside_dcp_is_one_error_naming_the_checkpoint(one, monkeypatch):
    root, b, _ = one
    with monkeypatch.context() as m:
        fill_dcp_writes(m, error=PermissionError(errno.EACCES, "Permission denied"))
        with pytest.raises(CheckpointSaveError, match=rf"^checkpoint {root}/s2 was not saved \(PermissionError: "
                                                     r".*Permission denied\); its partial files are removed$") as e:
            b.save_checkpoint(root, "s2", {"step": 2}, max_keep=3)
    assert e.value.root == root
    assert_only_s1(root)


# ----------------------------------------------------------------------------- loading


def drop_checksums(path: str) -> None:
    """Make checkpoint `path` look written before checksums were recorded (no `files` in meta.json)."""
    meta_file = os.path.join(path, "meta.json")
    meta = json.load(open(meta_file))
    del meta["files"]
    with open(meta_file, "w") as f:
        json.dump(meta, f)


def zero_file(path: str) -> None:
    """Every byte zeroed, the size kept (a complete-looking checkpoint whose shard does not unpickle)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(b"\0" * size)


@pytest.mark.parametrize("damage, file, why", [
    (zero_file, "dcp/__0_0.distcp", r"dcp/ does not load \(UnpicklingError: "),  # torch's CheckpointException
    (break_zip, "trainer.pt", r"trainer\.pt does not read \("),
])
def test_a_damaged_checkpoint_without_checksums_falls_back_to_the_one_before(one, tiny_model_dir, caplog, damage,
                                                                             file, why):
    root, b, at_s1 = one
    b.save_checkpoint(root, "s2", {"step": 2}, max_keep=3)
    for tag in ("s1", "s2"):
        drop_checksums(os.path.join(root, tag))
    damage(os.path.join(root, "s2", file))
    fresh = new_backend(tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="rlhfkit.checkpoint.sharded"):
        assert fresh.load_checkpoint(root) == {"step": 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "rlhfkit.checkpoint.sharded"]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {root}/s2 is damaged: "), lines
    assert lines[0].endswith("(it records no checksums: written before they were); skipped"), lines
    assert len(lines[0]) < 600 and "\n" not in lines[0]
    assert re.search(why, lines[0]), lines[0]
    assert all(torch.equal(at_s1[k], v) for k, v in weights(fresh).items())

    damage(os.path.join(root, "s1", file))  # none left that reads: one error naming both
    with pytest.raises(FileNotFoundError, match=rf"--load_checkpoint: no intact checkpoint in {root}: checkpoint "
                                                rf"{root}/s2 is damaged: .*; skipped; checkpoint {root}/s1 is damaged"):
        new_backend(tiny_model_dir).load_checkpoint(root)


def test_a_checkpoint_whose_checksums_match_but_does_not_load_is_an_error(one, tmp_path):
    """Intact bytes that do not load are a checkpoint of another model: no fallback to an older one."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.config.configs import BackendConfig, OptimConfig
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model
    from rlhfkit.parallel.dist import DistInfo

    root, _, _ = one
    other_dir = make_tiny_model(str(tmp_path / "other"), TinyModelSpec(arch="llama", hidden_size=32,
                                                                       num_hidden_layers=1, num_attention_heads=2))
    other = FSDP2Backend(AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32),
                         BackendConfig(param_dtype="fp32"), OptimConfig(learning_rate=1e-3), 4,
                         DistInfo(device="cpu"))
    with pytest.raises(ckpt.CheckpointError, match=rf"^--load_checkpoint: {root}/s1 does not match this model and "
                                                   r"optimizer \(saved on 1 ranks\): [^\n]+$"):
        other.load_checkpoint(root)


def test_rl_pair_falls_back_past_an_actor_without_checksums_that_does_not_read(tiny_model_dir, tmp_path, caplog):
    from rlhfkit.trainers.rl_checkpoint import RLCheckpointer

    root = str(tmp_path / "rl")
    actor, critic = new_backend(tiny_model_dir), new_backend(tiny_model_dir)
    data = batches(actor.model.config.vocab_size, 4)
    saver = RLCheckpointer(actor, critic)
    for step in (1, 2):
        train(actor, data[step - 1:step])
        train(critic, data[step + 1:step + 2])
        saver.save(root, f"global_step{step}", {"step": step}, max_keep=2)
        if step == 1:
            actor_at_1 = weights(actor)
    for role in ("actor", "critic"):
        for step in (1, 2):
            drop_checksums(os.path.join(root, role, f"global_step{step}"))
    zero_file(os.path.join(root, "actor", "global_step2", "dcp", "__0_0.distcp"))
    a2, c2 = new_backend(tiny_model_dir), new_backend(tiny_model_dir)
    with caplog.at_level(logging.WARNING):
        assert RLCheckpointer(a2, c2).load(root) == {"step": 1}
    assert any(r.getMessage().startswith(f"checkpoint {root}/actor/global_step2 is damaged: dcp/ does not load")
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert all(torch.equal(actor_at_1[k], v) for k, v in weights(a2).items())
