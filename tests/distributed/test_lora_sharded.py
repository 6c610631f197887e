"""A LoRA policy under FSDP2 keeps its frozen base in the compute dtype (bf16) and its adapters in fp32,
in one sharded group: 2 ranks train as one process does, and only the adapters move."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
import torch

from helpers import subprocess_env, torchrun_cmd

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker():
    spec = importlib.util.spec_from_file_location("lora_worker", os.path.join(HERE, "lora_worker.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_ranks_shard_a_bf16_base_with_fp32_adapters_like_one_process(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlhfkit.parallel.dist import DistInfo

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torch.manual_seed(0)
    one = _worker().run(tiny_model_dir, DistInfo(device="cpu"), None)
    # loaded as train_ppo loads it: a bf16 base (half of fp32's host memory), fp32 adapters
    assert one["loaded"] == ["torch.bfloat16/frozen", "torch.float32/trainable"]
    proc = subprocess.run(torchrun_cmd(2, os.path.join(HERE, "lora_worker.py"), "--model_dir", tiny_model_dir,
                                       "--out", str(tmp_path)),
                          env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    two = json.loads((tmp_path / "result.json").read_text())
    assert two["sharded"] == ["torch.bfloat16/frozen", "torch.float32/trainable"]  # one FSDP group, two dtypes
    assert two["losses"] == pytest.approx(one["losses"], rel=2e-2)  # bf16 compute, another reduction order
    got = load_file(str(tmp_path / "weights.safetensors"))
    assert sorted(got) == sorted(one["weights"])
    base = {k: v.to(torch.bfloat16).float() for k, v in
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict().items()}
    moved = 0
    for k, v in got.items():
        if "lora_" in k:
            torch.testing.assert_close(v, one["weights"][k], rtol=5e-2, atol=5e-3)
            moved += int(k.endswith("lora_B.default.weight") and bool(v.abs().sum() > 0))  # B starts at 0
        else:  # the frozen base is the checkpoint's, rounded to bf16, on both
            name = k.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(v, base[name]) and torch.equal(one["weights"][k], base[name]), k
    assert moved > 0
