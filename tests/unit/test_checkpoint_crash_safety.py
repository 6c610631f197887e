"""Checkpoints after kills: mid-rotation leftovers and incomplete directories are never loaded,
resume takes the newest complete checkpoint whatever `latest` says."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from rlhfkit.checkpoint import sharded as ckpt
from rlhfkit.checkpoint.layout import checkpoint_gap, latest_checkpoint, list_checkpoints

from test_backend_checkpoint import batches, new_backend, train, weights


def set_index(path: str, index: int, **extra) -> None:
    meta = json.load(open(os.path.join(path, "meta.json")))
    meta.update(index=index, **extra)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def copy_as(root: str, src: str, name: str, index: int) -> str:
    dst = os.path.join(root, name)
    shutil.copytree(os.path.join(root, src), dst)
    set_index(dst, index)
    return dst


@pytest.fixture()
def three(tiny_model_dir, tmp_path):
    """Checkpoints s1, s2, s3 of one run, and the weights at s3."""
    root = str(tmp_path / "ck")
    b = new_backend(tiny_model_dir)
    data = batches(b.model.config.vocab_size, 3)
    for i in range(3):
        train(b, data[i:i + 1])
        b.save_checkpoint(root, f"s{i + 1}", {"step": i + 1}, max_keep=3)
    return root, b, weights(b)


def test_leftovers_of_a_kill_mid_rotation_are_never_loaded(tiny_model_dir, three):
    root, b, w3 = three
    # newer-looking leftovers, each with a higher save index than s3
    copy_as(root, "s1", "s0.del.tmp", 90)  # renamed away by rotation, not yet deleted
    copy_as(root, "s2", "s4.tmp", 91)  # a save killed before its rename
    no_weights = copy_as(root, "s2", "s5", 92)  # meta.json but no weights
    shutil.rmtree(os.path.join(no_weights, "dcp"))
    no_shard = copy_as(root, "s2", "s6", 93)  # the shard file named by dcp/.metadata is gone
    os.remove(os.path.join(no_shard, "dcp", "__0_0.distcp"))
    short = copy_as(root, "s2", "s7", 94)  # the shard file is cut short
    with open(os.path.join(short, "dcp", "__0_0.distcp"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    no_rng = copy_as(root, "s2", "s8", 95)  # saved on 2 ranks, rank 1's RNG state missing
    set_index(no_rng, 95, world_size=2)
    no_meta = copy_as(root, "s2", "s9", 96)  # metadata unreadable
    with open(os.path.join(no_meta, "dcp", ".metadata"), "wb") as f:
        f.write(b"\x80garbage")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("s5")

    assert checkpoint_gap(no_weights).startswith("has neither dcp/")
    assert checkpoint_gap(no_shard) == "dcp/__0_0.distcp is missing"
    assert "bytes" in checkpoint_gap(short)
    assert checkpoint_gap(no_rng) == "rng_1.pt is missing"
    assert "dcp/.metadata is unreadable" in checkpoint_gap(no_meta)
    assert [t for _, t in list_checkpoints(root)] == ["s1", "s2", "s3"]
    assert latest_checkpoint(root) == os.path.join(root, "s3")
    fresh = new_backend(tiny_model_dir)
    assert fresh.load_checkpoint(root) == {"step": 3}
    assert all(torch.equal(w3[k], v) for k, v in weights(fresh).items())

    b.save_checkpoint(root, "s10", {"step": 10}, max_keep=3)  # clears the *.tmp leftovers, rotates s1 out
    left = sorted(os.listdir(root))
    assert "s0.del.tmp" not in left and "s4.tmp" not in left and "s1" not in left
    assert [t for _, t in list_checkpoints(root)] == ["s2", "s3", "s10"]


def test_latest_lagging_behind_a_complete_checkpoint(tiny_model_dir, three):
    root, _, w3 = three
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("s2")  # a kill between the rename of s3 and the update of `latest`
    assert latest_checkpoint(root) == os.path.join(root, "s3")
    os.remove(os.path.join(root, "latest"))
    assert latest_checkpoint(root) == os.path.join(root, "s3")
    fresh = new_backend(tiny_model_dir)
    assert fresh.load_checkpoint(root) == {"step": 3}
    assert all(torch.equal(w3[k], v) for k, v in weights(fresh).items())


def test_rotation_killed_mid_delete_leaves_only_a_renamed_away_directory(tiny_model_dir, three, monkeypatch):
    root, b, _ = three
    real_rmtree = shutil.rmtree

    def killed_rmtree(path, ignore_errors=False):
        if not os.path.exists(path):
            return
        real_rmtree(os.path.join(path, "dcp"))  # part of the directory is gone, meta.json is not
        raise KeyboardInterrupt("killed mid-rotation")

    with monkeypatch.context() as m:
        m.setattr(ckpt.shutil, "rmtree", killed_rmtree)
        with pytest.raises(KeyboardInterrupt):
            b.save_checkpoint(root, "s4", {"step": 4}, max_keep=3)
    left = sorted(os.listdir(root))
    assert "s1" not in left and "s1.del.tmp" in left  # renamed away before the delete began
    assert os.path.isfile(os.path.join(root, "s1.del.tmp", "meta.json"))
    assert [t for _, t in list_checkpoints(root)] == ["s2", "s3", "s4"]
    assert new_backend(tiny_model_dir).load_checkpoint(root) == {"step": 4}
    b.save_checkpoint(root, "s5", {"step": 5}, max_keep=3)
    assert sorted(os.listdir(root)) == ["latest", "s3", "s4", "s5"]


def test_only_incomplete_checkpoints_is_an_error_naming_them(tiny_model_dir, three):
    root, _, _ = three
    for tag in ("s1", "s2", "s3"):
        os.remove(os.path.join(root, tag, "dcp", "__0_0.distcp"))
    with pytest.raises(FileNotFoundError, match=r"--load_checkpoint: no complete checkpoint in .*s3: "
                                                r"dcp/__0_0\.distcp is missing"):
        new_backend(tiny_model_dir).load_checkpoint(root)


def test_rl_pair_killed_between_critic_and_actor_resumes_from_the_previous_pair(tiny_model_dir, tmp_path):
    from rlhfkit.rl_run.builders import RLCheckpointer

    root = str(tmp_path / "rl")
    actor, critic = new_backend(tiny_model_dir), new_backend(tiny_model_dir)
    data = batches(actor.model.config.vocab_size, 4)
    saver = RLCheckpointer(actor, critic)
    for step in (1, 2):
        train(actor, data[step - 1:step])
        train(critic, data[step + 1:step + 2])
        saver.save(root, f"global_step{step}", {"step": step}, max_keep=1)
    critic_at_2 = weights(critic)
    train(critic, data[:1])

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed after the critic's save")

    actor.save_checkpoint = killed
    with pytest.raises(KeyboardInterrupt):
        saver.save(root, "global_step3", {"step": 3}, max_keep=1)
    assert [t for _, t in list_checkpoints(os.path.join(root, "critic"))] == ["global_step2", "global_step3"]
    assert [t for _, t in list_checkpoints(os.path.join(root, "actor"))] == ["global_step2"]
    a2, c2 = new_backend(tiny_model_dir), new_backend(tiny_model_dir)
    assert RLCheckpointer(a2, c2).load(root) == {"step": 2}
    assert all(torch.equal(critic_at_2[k], v) for k, v in weights(c2).items())
