"""Checkpoints: resume = uninterrupted run, RNG restored, atomic `latest`, rotation, aliases."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.checkpoint.files import load_tensors, save_tensors
from rlhfkit.checkpoint.layout import latest_checkpoint, list_checkpoints
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config.configs import BackendConfig, OptimConfig


def new_backend(model_dir: str) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = OptimConfig(learning_rate=1e-2, l2=0.01, lr_scheduler="cosine_with_min_lr",
                        lr_warmup_ratio=0.2, max_norm=1.0)
    return FSDP2Backend(model, BackendConfig(param_dtype="fp32"), optim, 6, DistInfo(device="cpu"))


def batches(vocab: int, n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(6, vocab, (4, 10), generator=g) for _ in range(n)]


def train(b: FSDP2Backend, data: list[torch.Tensor]) -> None:
    for ids in data:
        logits = b.model(input_ids=ids).logits[:, :-1]
        # dropout-like use of the global RNG, so a wrong RNG restore changes the weights
        noise = 1.0 + 0.1 * torch.rand(ids.shape[0], 1)
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        b.backward(-(logp * noise).sum() / logp.numel())
        b.optimizer_step()


def weights(b: FSDP2Backend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in b.full_state_dict().items()}


def test_resume_equals_uninterrupted_run(tiny_model_dir, tmp_path):
    root = str(tmp_path / "ckpt")
    a = new_backend(tiny_model_dir)
    data = batches(a.model.config.vocab_size)
    train(a, data[:3])
    a.save_checkpoint(root, "step3", {"step": 3, "data": {"epoch": 0, "pos": 12}}, max_keep=2)
    lr_at_save = a.lr
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    rand_after_save = (torch.rand(4), np.random.rand(2), random.random())
    torch.set_rng_state(states[0])  # undo the draws so `a` continues from the saved RNG
    np.random.set_state(states[1])
    random.setstate(states[2])
    train(a, data[3:])
    w = weights(a)

    b = new_backend(tiny_model_dir)
    client = b.load_checkpoint(root)
    assert client == {"step": 3, "data": {"epoch": 0, "pos": 12}}
    assert b.lr == lr_at_save
    assert torch.equal(torch.rand(4), rand_after_save[0])
    assert np.array_equal(np.random.rand(2), rand_after_save[1])
    assert random.random() == rand_after_save[2]
    # restore the RNG as it was at save time again, then run the same 3 steps
    b.load_checkpoint(root)
    train(b, data[3:])
    w2 = weights(b)
    assert all(torch.equal(w[k], w2[k]) for k in w)

    # control: the same 3 steps from a fresh optimizer (no resume) end elsewhere
    c = new_backend(tiny_model_dir)
    c.load_checkpoint(root)
    c.optimizer.state.clear()
    train(c, data[3:])
    assert max((w[k] - c.full_state_dict()[k]).abs().max().item() for k in w) > 1e-5


def test_files_are_sharded_and_load_with_weights_only(tiny_model_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    b = new_backend(tiny_model_dir)
    train(b, batches(b.model.config.vocab_size, 1))
    path = b.save_checkpoint(str(tmp_path), "t", {"step": 1}, max_keep=1)
    assert sorted(os.listdir(path)) == ["client_state.json", "dcp", "meta.json", "rng_0.pt", "trainer.pt"]
    assert sorted(os.listdir(os.path.join(path, "dcp"))) == [".metadata", "__0_0.distcp"]  # one file per rank
    saved = FileSystemReader(os.path.join(path, "dcp")).read_metadata().state_dict_metadata
    model_keys = {k[len("model."):] for k in saved if k.startswith("model.")}
    assert model_keys == set(b.model.state_dict())
    for name, p in b.model.named_parameters():  # optimizer state keyed by parameter name, not index
        assert saved[f"optim.state.{name}.exp_avg"].size == p.shape
    meta = json.load(open(os.path.join(path, "meta.json")))
    assert meta["world_size"] == 1 and meta["format"] == "dcp-v1" and meta["has_optim"] is True
    trainer = torch.load(os.path.join(path, "trainer.pt"), weights_only=True)
    assert trainer["scheduler"]["last_epoch"] == 1
    rng = torch.load(os.path.join(path, "rng_0.pt"), weights_only=True)
    assert set(rng) >= {"python", "numpy", "torch"}


def test_checkpoint_before_the_first_step_keeps_the_optimizer_fresh(tiny_model_dir, tmp_path):
    a = new_backend(tiny_model_dir)
    data = batches(a.model.config.vocab_size)
    a.save_checkpoint(str(tmp_path), "s0", {"step": 0}, max_keep=1)
    assert not a.optimizer.state  # saving did not create optimizer state (Adam's step count stays 0)
    assert json.load(open(tmp_path / "s0" / "meta.json"))["has_optim"] is False
    train(a, data[:2])
    b = new_backend(tiny_model_dir)
    train(b, data[2:4])  # a run that has stepped, then loads the step-0 checkpoint
    b.load_checkpoint(str(tmp_path))
    assert not b.optimizer.state
    train(b, data[:2])
    w, w2 = weights(a), weights(b)
    assert all(torch.equal(w[k], w2[k]) for k in w)


def test_full_state_checkpoint_of_the_earlier_format_loads(tiny_model_dir, tmp_path):
    a = new_backend(tiny_model_dir)
    data = batches(a.model.config.vocab_size)
    train(a, data[:2])
    old = tmp_path / "old"
    old.mkdir()
    save_tensors(str(old / "model.safetensors"), a.full_state_dict())
    torch.save(a.optimizer_state_dict(), old / "optim.pt")
    torch.save(a.trainer_state(), old / "trainer.pt")
    from rlhfkit.checkpoint.files import rng_state

    torch.save(rng_state(), old / "rng_0.pt")
    (old / "client_state.json").write_text('{"step": 2}')
    (old / "meta.json").write_text('{"tag": "old", "index": 0, "world_size": 1}')
    train(a, data[2:])
    b = new_backend(tiny_model_dir)
    assert b.load_checkpoint(str(tmp_path)) == {"step": 2}
    train(b, data[2:])
    w, w2 = weights(a), weights(b)
    assert all(torch.equal(w[k], w2[k]) for k in w)
    os.remove(old / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="--load_checkpoint: .*has neither dcp/"):
        new_backend(tiny_model_dir).load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("crash_at", ["rng", "publish"])
def test_crash_mid_save_is_never_loaded(tiny_model_dir, tmp_path, monkeypatch, crash_at):
    """A save killed after the shards were written (before / after meta.json) leaves `<tag>.tmp`,
    which is never loaded; the next save removes it."""
    from rlhfkit.checkpoint import sharded as ckpt

    root = str(tmp_path)
    a = new_backend(tiny_model_dir)
    data = batches(a.model.config.vocab_size)
    train(a, data[:1])
    a.save_checkpoint(root, "s1", {"step": 1}, max_keep=3)
    w1 = weights(a)
    train(a, data[1:2])

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m:
        m.setattr(ckpt, "torch_save" if crash_at == "rng" else "_publish", killed)
        with pytest.raises(KeyboardInterrupt):
            a.save_checkpoint(root, "s2", {"step": 2}, max_keep=3)
    assert os.path.isdir(os.path.join(root, "s2.tmp", "dcp"))
    assert os.path.exists(os.path.join(root, "s2.tmp", "meta.json")) == (crash_at == "publish")
    assert latest_checkpoint(root) == os.path.join(root, "s1")
    b = new_backend(tiny_model_dir)
    assert b.load_checkpoint(root) == {"step": 1}
    assert all(torch.equal(w1[k], v) for k, v in weights(b).items())
    a.save_checkpoint(root, "s3", {"step": 3}, max_keep=3)
    assert sorted(os.listdir(root)) == ["latest", "s1", "s3"]


def test_leftover_tmp_is_never_latest(tiny_model_dir, tmp_path):
    root = str(tmp_path)
    b = new_backend(tiny_model_dir)
    b.save_checkpoint(root, "a", {"step": 1}, max_keep=3)
    # a crash mid-save leaves a complete-looking "<tag>.tmp" with a newer index
    shutil.copytree(os.path.join(root, "a"), os.path.join(root, "b.tmp"))
    with open(os.path.join(root, "b.tmp", "meta.json"), "w") as f:
        json.dump({"tag": "b", "index": 99}, f)
    assert latest_checkpoint(root) == os.path.join(root, "a")
    os.remove(os.path.join(root, "latest"))  # even without the latest file
    assert latest_checkpoint(root) == os.path.join(root, "a")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("b.tmp")
    assert latest_checkpoint(root) == os.path.join(root, "a")
    assert new_backend(tiny_model_dir).load_checkpoint(root) == {"step": 1}
    b.save_checkpoint(root, "c", {"step": 2}, max_keep=3)
    assert not os.path.exists(os.path.join(root, "b.tmp"))  # stale tmp cleared by the next save
    assert open(os.path.join(root, "latest")).read() == "c"


def test_max_keep_and_missing(tiny_model_dir, tmp_path):
    root = str(tmp_path / "ck")
    b = new_backend(tiny_model_dir)
    assert b.load_checkpoint(root) is None
    for i in range(4):
        b.save_checkpoint(root, f"global_step{i}", {"step": i}, max_keep=2)
    assert [t for _, t in list_checkpoints(root)] == ["global_step2", "global_step3"]
    assert sorted(os.listdir(root)) == ["global_step2", "global_step3", "latest"]
    b.save_checkpoint(root, "global_step2", {"step": 22}, max_keep=2)  # re-save a tag: now newest
    assert open(os.path.join(root, "latest")).read() == "global_step2"
    assert new_backend(tiny_model_dir).load_checkpoint(root) == {"step": 22}
    with pytest.raises(ValueError, match="--max_ckpt_num"):
        b.save_checkpoint(root, "x", {}, max_keep=0)
    with pytest.raises(TypeError, match="JSON"):
        b.save_checkpoint(root, "x", {"bad": object()}, max_keep=2)


def test_save_tensors_keeps_tied_weights(tmp_path):
    w = torch.randn(5, 3)
    sd = {"embed.weight": w, "head.weight": w, "view": w[1:3], "other": torch.ones(2)}
    save_tensors(str(tmp_path / "m.safetensors"), sd)
    back = load_tensors(str(tmp_path / "m.safetensors"))
    assert set(back) == set(sd)
    assert back["embed.weight"] is back["head.weight"]
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_max_ckpt_mem_removes_the_oldest_while_over_the_limit(tiny_model_dir, tmp_path, caplog):
    """--max_ckpt_mem (GB): after a save the oldest checkpoints go while the rest hold more; the one just
    saved always stays, with a warning when it alone is over."""
    from rlhfkit.checkpoint.rotation import dir_bytes

    root = str(tmp_path / "ckpt")
    b = new_backend(tiny_model_dir)
    data = batches(b.model.config.vocab_size)
    train(b, data[:1])
    b.save_checkpoint(root, "step1", {"step": 1}, max_keep=10)
    one = dir_bytes(os.path.join(root, "step1"))
    b.cfg.max_ckpt_mem = 2.5 * one / 2**30  # room for two checkpoints of this size, not three
    for k in (2, 3, 4):
        train(b, data[k - 1:k])
        b.save_checkpoint(root, f"step{k}", {"step": k}, max_keep=10)
    assert [t for _, t in list_checkpoints(root)] == ["step3", "step4"]
    assert not [n for n in os.listdir(root) if n.startswith("step1") or n.startswith("step2")]
    b.cfg.max_ckpt_mem = 0.5 * one / 2**30  # smaller than one checkpoint
    with caplog.at_level("WARNING"):
        b.save_checkpoint(root, "step5", {"step": 5}, max_keep=10)
    assert [t for _, t in list_checkpoints(root)] == ["step5"]
    assert "alone holds" in caplog.text
    c = new_backend(tiny_model_dir)
    assert c.load_checkpoint(root) == {"step": 5}
