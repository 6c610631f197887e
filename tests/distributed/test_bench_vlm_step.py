"""bench/rl_step_vlm.py on CPU: the tiny Qwen2.5-VL shape, train_ppo_ray's trainer colocated over 2 CPU
slots (2 FSDP2 policy ranks, an engine on each), one warm-up and one timed GRPO step, run as the GPU
driver runs it (a subprocess); its JSON's figures are checked against each other, the model directory
and the prompt worked out by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

pytest.importorskip("ray")
pytestmark = pytest.mark.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rl_step_vlm_tiny_cpu(tmp_path):
    out, model = tmp_path / "rl_step_vlm.json", tmp_path / "model"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, os.path.join(ROOT, "bench", "rl_step_vlm.py"), "--shape", "tiny", "--device", "cpu",
           "--ray_gpus", "2", "--prompts", "2", "--n", "2", "--new_tokens", "4", "--picture", "56", "--steps", "1",
           "--model_dir", str(model), "--freeze_visual_encoder", "--recompute_old_logprobs", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    d = json.loads(out.read_text())
    assert d["complete"] and "error" not in d, d.get("error")
    assert d["bench"] == "rl_step_vlm" and d["shape"] == "tiny" and d["device_count"] == 0
    # 1 warm-up + 1 timed step; every phase ran and they fit inside the step's wall time
    assert len(d["warmup_s_each"]) == 1 and len(d["step_s_each"]) == 1 and len(d["phases_each"]) == 1
    assert d["step_s"] == d["step_s_each"][0] > 0
    assert all(d["phases_s"][p] > 0 for p in ("generate", "logprobs", "train", "weight_sync")), d["phases_s"]
    assert sum(d["phases_s"].values()) <= d["step_s"]
    assert d["old_logprobs_pass_each"] == [1.0]  # --recompute_old_logprobs: a log-prob pass of its own
    assert d["skipped_zero_advantage_steps"] == 0 and 0 <= d["reward"] < 1
    # 4 completions of exactly 4 tokens; tokens/s is over the generate phase
    assert d["response_length"] == 4 and d["min_new_tokens"] == 4
    assert d["gen_tokens_per_s"] == pytest.approx(4 * 4 / d["phases_s"]["generate"])
    # a 56-pixel picture is (56 / 28)^2 = 4 picture tokens; the prompt (character tokenizer, chat template):
    # <|im_start|> "user\n" (1 + 5) + vision start, 4 pads, vision end (6) + "What colour is the background?" (30)
    # + <|im_end|> "\n" (2) + <|im_start|> "assistant\n" (1 + 10) = 55 tokens
    assert d["picture_tokens"] == d["expected_picture_tokens"] == 4
    assert d["prompt_tokens"] == 55
    # 2 policy ranks and 2 engines, one of each on each slot of the colocated pool
    assert sorted((p["role"], p["rank"], p["bundle"]) for p in d["placement"]) == [
        ("engine", 0, 0), ("engine", 1, 1), ("policy", 0, 0), ("policy", 1, 1)]
    # --freeze_visual_encoder: the engines get the language model and head only (fp32 on CPU)
    w = load_file(str(model / "model.safetensors"))
    lm = sum(t.numel() for k, t in w.items() if "visual" not in k)
    assert lm < sum(t.numel() for t in w.values()) == d["model_write"]["parameters"]
    assert d["weight_sync_mb"] == pytest.approx(lm * 4 / 2**20)
    assert d["gpu_peak_mem_gb"] == [] and len(d["memory_steps"]) == 1
    assert "step 0 (warm-up)" in proc.stdout and "step 1 " in proc.stdout
