"""QLoRA GRPO on CUDA (tests/integration/test_qlora_rl.py runs the same on CPU): the builtin engine serves the
policy's 4-bit base (bitsandbytes' CUDA dequantization into the engine's scratch, inside CUDA graphs) with
the adapters unmerged, its sampling log-probs agree with the trainer's (train/vllm_kl), and a run resumed from
its step-2 checkpoint (bf16 weights with fp32 master adapters; the checkpoint without the 4-bit base) ends as
the uninterrupted one (up to the GPU's summation order).

    pytest -q tests/gpu/test_qlora_gpu.py
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from helpers import rl_flags, write_rl_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("bitsandbytes")


def _run(model: str, d: str, save: str, *extra: str) -> dict:
    from safetensors.torch import load_file

    from rlhfkit.cli import train_ppo

    argv = [a if a != "cpu" else "cuda" for a in rl_flags(model, d, save, "--lora_rank", "4", "--lora_alpha", "8",
                                                          "--load_in_4bit", "--param_dtype", "bf16", *extra, steps=3)]
    parser = train_ppo.build_parser()
    train_ppo.run.__wrapped__(parser.parse(argv), parser)
    with open(os.path.join(save, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {"metrics": recs, "adapters": load_file(os.path.join(save, "adapter_model.safetensors"))}


def test_qlora_grpo_on_cuda_resumes(tiny_qwen2_dir, tmp_path, caplog):
    d = write_rl_data(str(tmp_path))
    ck = str(tmp_path / "ck")
    with caplog.at_level(logging.INFO):
        whole = _run(tiny_qwen2_dir, d, str(tmp_path / "whole"), "--save_steps", "1", "--ckpt_path", ck,
                     "--max_ckpt_num", "5")
    assert "serves the policy's own weights and LoRA adapters, unmerged" in caplog.text
    for r in whole["metrics"]:
        assert r["train/vllm_kl"] < 2e-3, r["train/vllm_kl"]
    shutil.copytree(ck, tmp_path / "ck2")
    shutil.rmtree(tmp_path / "ck2" / "actor" / "global_step3")
    (tmp_path / "ck2" / "actor" / "latest").write_text("global_step2")
    resumed = _run(tiny_qwen2_dir, d, str(tmp_path / "resumed"), "--save_steps", "1", "--ckpt_path",
                   str(tmp_path / "ck2"), "--load_checkpoint")
    assert whole["adapters"].keys() == resumed["adapters"].keys()
    for k, t in whole["adapters"].items():
        # (the GPU's attention backward sums in no fixed order: equal up to that)
        torch.testing.assert_close(resumed["adapters"][k], t, atol=1e-4, rtol=0, msg=k)
