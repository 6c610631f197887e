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
from rlhfkit.backend.checkpoint import latest_checkpoint, list_checkpoints, load_tensors, save_tensors
from rlhfkit.backend.dist import DistInfo
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


def test_files_load_with_weights_only(tiny_model_dir, tmp_path):
    b = new_backend(tiny_model_dir)
    train(b, batches(b.model.config.vocab_size, 1))
    path = b.save_checkpoint(str(tmp_path), "t", {"step": 1}, max_keep=1)
    optim = torch.load(os.path.join(path, "optim.pt"), weights_only=True)
    names = set(dict(b.model.named_parameters()))
    assert set(optim["state"]) == names  # keyed by parameter name, not index
    assert optim["param_groups"][0]["betas"] == (0.9, 0.95)
    trainer = torch.load(os.path.join(path, "trainer.pt"), weights_only=True)
    assert trainer["scheduler"]["last_epoch"] == 1
    rng = torch.load(os.path.join(path, "rng_0.pt"), weights_only=True)
    assert set(rng) >= {"python", "numpy", "torch"}
    assert set(load_tensors(os.path.join(path, "model.safetensors"))) == set(b.model.state_dict())


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
