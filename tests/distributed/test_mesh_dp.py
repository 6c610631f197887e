"""Reductions and sampling use the data-parallel group: 4 ranks as dp 2 x tp 2 == 2 ranks of pure DP.

mesh_dp_worker.py runs the SFT loop (2 steps + evaluation) and an RL step (REINFORCE++ batch
whitening, one PPO update) under torchrun with gloo on CPU. On the dp 2 x tp 2 mesh the model is
replicated over tp (no tensor-parallel layers yet), so each tp pair must see the same rows and
every count, loss and metric must be reduced over the dp group only: summed over the whole
world, the token counts would double (losses halved) and the data would be cut into 4 shares.

Tolerances: the two runs add the same fp32 terms in the same order on ranks that hold the same
rows, so losses agree to 1e-6 relative; the weight checksums (sum of |w| over ~145k fp32
parameters) to 1e-6 relative.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from helpers import subprocess_env, torchrun_cmd

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_worker(nproc: int, tp: int, model_dir: str, out: str) -> dict:
    cmd = torchrun_cmd(nproc, os.path.join(HERE, "mesh_dp_worker.py"), "--model", model_dir, "--tp", str(tp),
                       "--out", out)
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


def test_dp2_tp2_equals_two_rank_data_parallel(tiny_model_dir, tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dp = run_worker(2, 1, tiny_model_dir, str(tmp_path / "dp2.json"))
    mesh = run_worker(4, 2, tiny_model_dir, str(tmp_path / "dp2_tp2.json"))

    assert len(dp["sft"]) == len(mesh["sft"]) == 2
    for a, b in zip(dp["sft"], mesh["sft"]):
        for k in ("train/loss", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-6), f"SFT {k}: {b[k]} != {a[k]}"
    assert dp["sft"][0]["train/loss"] > 1.0  # a real NLL, not a vacuous 0
    assert mesh["sft_eval"]["eval/loss"] == pytest.approx(dp["sft_eval"]["eval/loss"], rel=1e-6)
    for k in ("policy_loss", "grad_norm", "ppo_clip_ratio"):
        assert mesh["rl"][k] == pytest.approx(dp["rl"][k], rel=1e-6, abs=1e-9), f"RL {k}"
    assert abs(dp["rl"]["policy_loss"]) > 1e-4 and dp["rl"]["grad_norm"] > 1e-4
    # whitened over the global batch: mean 0 and mean square 1 over the action tokens, both runs
    assert mesh["adv"] == pytest.approx(dp["adv"], rel=1e-6, abs=1e-9)
    assert abs(dp["adv"][0]) < 1e-6
    assert mesh["sft_weights"] == pytest.approx(dp["sft_weights"], rel=1e-6)
    assert mesh["rl_weights"] == pytest.approx(dp["rl_weights"], rel=1e-6)
