"""Checkpoints prove their integrity: meta.json records each file's size and SHA-256; a checkpoint cut
short, with a broken zip structure, or with altered tensor bytes is skipped with one line naming it
and the file, and the newest intact one loads (or, none intact, an error naming them)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

import pytest
import torch

from rlhfkit.checkpoint.integrity import checkpoint_damage
from rlhfkit.checkpoint.layout import list_checkpoints

from test_backend_checkpoint import batches, new_backend, train, weights


@pytest.fixture()
def two(tiny_model_dir, tmp_path):
    """Checkpoints s1 and s2 of one run, and the weights at s1."""
    root = str(tmp_path / "ck")
    b = new_backend(tiny_model_dir)
    data = batches(b.model.config.vocab_size, 2)
    train(b, data[:1])
    b.save_checkpoint(root, "s1", {"step": 1}, max_keep=3)
    at_s1 = weights(b)
    train(b, data[1:])
    b.save_checkpoint(root, "s2", {"step": 2}, max_keep=3)
    return root, at_s1


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def break_zip(path: str) -> None:
    """Overwrite the end of a torch file: its zip central directory."""
    with open(path, "r+b") as f:
        f.seek(-40, os.SEEK_END)
        f.write(b"\xff" * 40)


def zero_tensor_bytes(path: str) -> None:
    """Zero 64 KB in the middle of the shard's tensor data (sizes unchanged)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\0" * min(65536, size // 4))


def test_meta_records_size_and_sha256_of_every_file(two):
    root, _ = two
    path = os.path.join(root, "s2")
    files = json.load(open(os.path.join(path, "meta.json")))["files"]
    on_disk = sorted(os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns)
    assert sorted(files) == [f for f in on_disk if f != "meta.json"]
    for rel, rec in files.items():
        data = open(os.path.join(path, rel), "rb").read()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert checkpoint_damage(path) is None


@pytest.mark.parametrize("damage, file, why", [
    (truncate, "rng_0.pt", r"rng_0\.pt has \d+ bytes, \d+ were written"),
    (break_zip, "trainer.pt", r"trainer\.pt does not match its checksum"),
    (zero_tensor_bytes, "dcp/__0_0.distcp", r"dcp/__0_0\.distcp does not match its checksum"),
])
def test_a_damaged_checkpoint_is_skipped_for_the_newest_intact_one(tiny_model_dir, two, caplog, damage, file, why):
    root, at_s1 = two
    damage(os.path.join(root, "s2", file))
    b = new_backend(tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="rlhfkit.checkpoint.sharded"):
        assert b.load_checkpoint(root) == {"step": 1}
    lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {root}/s2 is damaged: ") and lines[0].endswith(
        "; skipped"), lines
    assert re.search(why, lines[0]), lines[0]
    assert all(torch.equal(at_s1[k], v) for k, v in weights(b).items())


def test_none_intact_is_an_error_naming_each(tiny_model_dir, two):
    root, _ = two
    zero_tensor_bytes(os.path.join(root, "s1", "dcp", "__0_0.distcp"))
    break_zip(os.path.join(root, "s2", "rng_0.pt"))
    with pytest.raises(FileNotFoundError, match=r"--load_checkpoint: no intact checkpoint in .*ck: checkpoint .*s2 "
                                                r"is damaged: rng_0\.pt does not match .*; checkpoint .*s1 is damaged: "
                                                r"dcp/__0_0\.distcp does not match"):
        new_backend(tiny_model_dir).load_checkpoint(root)
    assert [t for _, t in list_checkpoints(root)] == ["s1", "s2"]  # nothing deleted: the user decides


def test_rl_pair_falls_back_past_a_damaged_critic(tiny_model_dir, tmp_path, caplog):
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
    zero_tensor_bytes(os.path.join(root, "critic", "global_step2", "dcp", "__0_0.distcp"))
    a2, c2 = new_backend(tiny_model_dir), new_backend(tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="rlhfkit.checkpoint.integrity"):
        assert RLCheckpointer(a2, c2).load(root) == {"step": 1}
    assert any(f"{root}/critic/global_step2 is damaged: dcp/__0_0.distcp" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(actor_at_1[k], v) for k, v in weights(a2).items())
