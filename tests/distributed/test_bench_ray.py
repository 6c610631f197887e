"""bench/rl_step.py --ray_layout disaggregated on CPU (tiny model, its own local Ray, gloo weight
broadcast), run as the GPU script runs it (a subprocess); its JSON's figures are checked against
each other and against the model directory."""

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


def test_rl_step_ray_disaggregated_cpu(tmp_path):
    out, model = tmp_path / "rl_step_ray.json", tmp_path / "model"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, os.path.join(ROOT, "bench", "rl_step.py"), "--ray_layout", "disaggregated",
           "--device", "cpu", "--model", "tiny", "--model_dir", str(model), "--prompts", "4", "--n", "2",
           "--prompt_len", "12", "--new_tokens", "6", "--steps", "2", "--weight_sync_bucket_mb", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    [run] = d["runs"]
    assert "error" not in run, run.get("error")
    assert d["complete"] and d["ray_layout"] == "disaggregated" and run["ray_layout"] == "disaggregated"
    assert d["weight_sync_method"].startswith("broadcast over gloo")
    assert run["weight_sync_methods_logged"] == ["broadcast"]
    # one policy rank and one engine, each in its own pool
    assert sorted((p["role"], p["pool"]) for p in run["placement"]) == [("engine", "engines"), ("policy", "policy")]
    # MB synced = the model's fp32 parameters (tied ones once), as saved in its directory
    w = load_file(str(model / "model.safetensors"))
    assert d["weight_sync_mb"] == pytest.approx(sum(t.numel() * 4 for t in w.values()) / 2**20)
    # 2 timed steps after a warm-up; the loop's phases fit inside each step's wall time
    assert len(run["step_s_each"]) == 2 and run["step_s"] == pytest.approx(sum(run["step_s_each"]) / 2)
    assert 0 < sum(d["phases_s"].values()) <= run["step_s"]
    assert 0 < d["weight_push_s"] <= d["weight_sync_s"] <= run["step_s"]
    assert "step 0 (warm-up)" in proc.stdout and "step 2" in proc.stdout
    # the memory plan's pools are each compared with what was measured (nothing on CPU: no CUDA peaks)
    assert set(run["memory_check"]) == set(run["memory_plan"]["pools"]) == {"policy", "engines"}
    assert len(run["memory_steps"]) == 2 and len(run["memory_steps"][0]["roles"]["policy"]) == 1
    assert run["memory_check"]["policy"]["plan_peak_gib"] == run["memory_plan"]["pools"]["policy"]["peak_gib"] > 0
