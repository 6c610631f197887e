"""A full disk: saves check the free space first, a failed save names the path with the bytes needed and
free, keeps the checkpoints already there and removes its own partial files."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from rlhfkit.checkpoint import sharded as ckpt
from rlhfkit.checkpoint import hf_export
from rlhfkit.fileio import GB, NoSpaceError, is_no_space

from test_backend_checkpoint import batches, new_backend, train, weights


def test_no_space_is_told_by_errno_or_message_through_the_chain():
    assert is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("unexpected pos 704 vs 598") from e
    except RuntimeError as e:
        assert is_no_space(e)
    assert not is_no_space(RuntimeError("unexpected pos 704 vs 598"))
    assert str(NoSpaceError("/d", 3 * GB, GB // 2)) == "no space left on /d: need 3 GB, have 0.5 GB"


def test_too_little_space_is_refused_before_writing(tiny_model_dir, tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    b = new_backend(tiny_model_dir)
    data = batches(b.model.config.vocab_size, 2)
    train(b, data[:1])
    b.save_checkpoint(root, "s1", {"step": 1}, max_keep=3)
    at_s1 = weights(b)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "s1")) for f in fs)
    train(b, data[1:])
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 1000)
    with pytest.raises(NoSpaceError) as e:
        b.save_checkpoint(root, "s2", {"step": 2}, max_keep=3)
    assert str(e.value) == f"no space left on {root}: need {e.value.need / GB:.3g} GB, have {1000 / GB:.3g} GB"
    assert e.value.need >= size  # at least the size of the last checkpoint
    assert sorted(os.listdir(root)) == ["latest", "s1"]  # nothing written, the last good one kept
    c = new_backend(tiny_model_dir)
    assert c.load_checkpoint(root) == {"step": 1}
    assert all(torch.equal(at_s1[k], v) for k, v in weights(c).items())


def test_running_out_mid_write_names_the_path_and_removes_the_partial_files(tiny_model_dir, tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    b = new_backend(tiny_model_dir)
    train(b, batches(b.model.config.vocab_size, 1))
    free = iter([10 * GB, 1000, 1000])  # room at the check; full once the write failed, and after its cleanup

    def torch_save_disk_full(obj, path):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt, "free_bytes", lambda path: next(free))
    monkeypatch.setattr(ckpt, "torch_save", torch_save_disk_full)
    with pytest.raises(NoSpaceError, match=rf"^no space left on {root}: need .* GB, have 9.31e-07 GB$"):
        b.save_checkpoint(root, "s1", {"step": 1}, max_keep=3)
    assert os.listdir(root) == []  # the partial s1.tmp is gone


def test_hf_export_checks_space_and_leaves_no_staging_folder(tiny_model_dir, tmp_path, monkeypatch):
    b = new_backend(tiny_model_dir)
    out = str(tmp_path / "hf")
    monkeypatch.setattr(hf_export, "free_bytes", lambda path: 4096)
    with pytest.raises(NoSpaceError, match=rf"^no space left on {out}: need 0.0\d+ GB, have 3.81e-06 GB$"):
        b.save_hf(out)
    free = iter([10 * GB, 4096])
    monkeypatch.setattr(hf_export, "free_bytes", lambda path: next(free))
    real = hf_export.write_config

    def full_disk(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_export, "write_config", full_disk)
    with pytest.raises(NoSpaceError, match=rf"^no space left on {out}:"):
        b.save_hf(out)
    assert os.listdir(out) == []  # the staging folder went with its partial files
    monkeypatch.setattr(hf_export, "write_config", real)
