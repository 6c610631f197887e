"""Crash-safe files: run_config.json and the final Hugging Face directory are never seen half written."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from rlhfkit import fileio
from rlhfkit.backend import FSDP2Backend
from rlhfkit.checkpoint import hf_export
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.config.flags import write_resolved_config


class Killed(BaseException):
    pass


def backend(model_dir: str, seed: int) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # a distinct model per seed
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return FSDP2Backend(model, BackendConfig(param_dtype="fp32"), OptimConfig(), 1, DistInfo(device="cpu"))


def logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([[5, 6, 7, 8]])).logits


def test_run_config_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    run = str(tmp_path)
    write_resolved_config(argparse.Namespace(learning_rate=1.0), run)
    with monkeypatch.context() as m:
        def killed(*a, **k):
            raise Killed()

        m.setattr(fileio.os, "replace", killed)  # killed after writing the temporary file
        with pytest.raises(Killed):
            write_resolved_config(argparse.Namespace(learning_rate=2.0), run)
    assert json.load(open(tmp_path / "run_config.json"))["learning_rate"] == 1.0
    write_resolved_config(argparse.Namespace(learning_rate=3.0), run)
    assert json.load(open(tmp_path / "run_config.json"))["learning_rate"] == 3.0
    assert sorted(os.listdir(run)) == ["run_config.json"]


def test_export_killed_while_writing_leaves_the_old_model(tiny_model_dir, tmp_path, monkeypatch):
    out = str(tmp_path / "hf")
    a, b = backend(tiny_model_dir, 1), backend(tiny_model_dir, 2)
    a.save_hf(out, max_shard_size=40_000)
    (tmp_path / "hf" / "metrics.jsonl").write_text('{"step": 1}\n')  # the run's files live here too
    before = logits(out)
    real = hf_export._write_tensor
    calls = {"n": 0}

    def dies_midway(f, t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise Killed()
        real(f, t)

    with monkeypatch.context() as m:
        m.setattr(hf_export, "_write_tensor", dies_midway)
        with pytest.raises(Killed):
            b.save_hf(out, max_shard_size=40_000)
    torch.testing.assert_close(logits(out), before, rtol=0, atol=0)
    b.save_hf(out)  # one file now: the staging leftover and the earlier shards go
    names = sorted(os.listdir(out))
    assert fileio.STAGING not in names and not any(n.startswith("model-") for n in names)
    assert "metrics.jsonl" in names and "model.safetensors" in names
    assert not torch.equal(logits(out), before)


def test_export_killed_while_publishing_never_loads_a_mix(tiny_model_dir, tmp_path, monkeypatch):
    out = str(tmp_path / "hf")
    a, b = backend(tiny_model_dir, 1), backend(tiny_model_dir, 2)
    a.save_hf(out)
    real = os.replace

    def dies_before_config(src, dst):
        if os.path.basename(dst) == "config.json":
            raise Killed()
        real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(fileio.os, "replace", dies_before_config)
        with pytest.raises(Killed):
            b.save_hf(out)
    # the new weights are in place, the old config.json is gone: the directory does not load at all
    assert not os.path.exists(os.path.join(out, "config.json"))
    with pytest.raises(Exception):
        logits(out)
    b.save_hf(out)
    expected = b.unwrap()(torch.tensor([[5, 6, 7, 8]])).logits
    torch.testing.assert_close(logits(out), expected, rtol=1e-5, atol=1e-5)
