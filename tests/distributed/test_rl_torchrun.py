"""`torchrun --nproc_per_node 2 -m rlhfkit.cli.train_ppo` (gloo, CPU) == one process, same global batch.

GRPO (group_norm), 4 prompts x 2 samples per step, train_batch_size = 8 (one optimizer step per RL
step), the builtin engine. Each rank generates its half of the prompts; a sample's seed depends
only on (seed, step, global sample index), and the engine draws a seeded request's randomness
from its own generator, so both runs sample the same tokens. Every loss divides by the global
token count and FSDP2 sums gradients over ranks, so the updates agree up to float32 summation order.

Tolerances:
- reward, reward_std, response_length, truncated_rate: 1e-6. These are functions of the sampled
  tokens; one differing token changes the reward by >= 1/(6 x 8) ~ 0.02.
- policy_loss, kl_loss, kl, advantage, grad_norm: rel 1e-4 (abs 1e-6 near 0). The two runs add the
  same fp32 terms in a different order (two partial sums all-reduced vs one sum), an error of about
  1e-7 relative per reduction, carried through 3 Adam steps.
- final weights: 1e-5 absolute, while 3 steps at lr 1e-3 move them by ~2e-3 (checked > 1e-3): Adam's
  update m / sqrt(v) is scale-free, so gradient errors of ~1e-6 relative give ~lr x 1e-6 per step.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from helpers import length_reward_src, read_run, rl_flags, subprocess_env, torchrun_cmd
from safetensors.torch import load_file

from rlhfkit.cli import train_ppo
from rlhfkit.tasks.addition import addition_splits

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SAMPLE_KEYS = ["train/reward", "train/reward_std", "train/response_length", "train/truncated_rate", "train/even_frac"]
TRAIN_KEYS = ["train/policy_loss", "train/kl_loss", "train/kl", "train/advantage", "train/grad_norm"]



def test_two_ranks_match_one_process(tiny_model_dir, data_dir):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    two = os.path.join(data_dir, "two_ranks")
    cmd = torchrun_cmd(2, "-m", "rlhfkit.cli.train_ppo", *rl_flags(tiny_model_dir, data_dir, two, steps=3))
    proc = subprocess.Popen(cmd, env=subprocess_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    one = os.path.join(data_dir, "one_process")  # runs while torchrun starts up
    train_ppo.main(rl_flags(tiny_model_dir, data_dir, one, steps=3))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-5000:]

    (r1, w1), (r2, w2) = read_run(one), read_run(two)
    assert [r["step"] for r in r1] == [r["step"] for r in r2] == [1, 2, 3]
    for a, b in zip(r1, r2):
        for k in SAMPLE_KEYS:
            assert b[k] == pytest.approx(a[k], abs=1e-6), f"step {a['step']} {k}: sampled tokens differ"
        for k in TRAIN_KEYS:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), f"step {a['step']} {k}: {b[k]} != {a[k]}"
    assert max(abs(r["train/policy_loss"]) for r in r1) > 1e-3, "policy_loss ~ 0 at every step: a vacuous comparison"
    w0 = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w0) > 1e-3
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)


def test_step_with_no_trajectory_on_one_rank_is_skipped_on_both(tiny_model_dir, tmp_path):
    """Rank 1's prompts of step 1 all fail under --reward_failure drop: both ranks skip step 1 (the
    decision is all-reduced; a rank skipping alone would hang the other in a collective) and train on."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from rlhfkit.trainers.offline import epoch_order

    rows, _ = addition_splits(12, 2, seed=7)
    bad = set(epoch_order(12, 0, 42)[2:4])  # rank 1's share of step 1 (2 prompts a rank, seed 42)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"input": ("x" if i in bad else "") + r["input"], "label": r["label"]}) + "\n"
                     for i, r in enumerate(rows))
    (tmp_path / "reward.py").write_text(length_reward_src(
        "    if any('x' in p for p in prompts):\n        raise ValueError('no verifier')\n"))
    save = str(tmp_path / "out")
    cmd = torchrun_cmd(2, "-m", "rlhfkit.cli.train_ppo", *rl_flags(tiny_model_dir, str(tmp_path), save, steps=3),
                       "--reward_failure", "drop")
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    recs, _ = read_run(save)
    assert [r["train/skipped_steps"] for r in recs] == [1.0, 0.0, 0.0]
    assert recs[0]["train/dropped_samples"] == 4.0 and "train/policy_loss" in recs[1]
    skipped = [line for line in proc.stderr.splitlines() if "skipped, no trajectory" in line]
    assert len(skipped) == 1 and skipped[0].startswith("step 1:") and "(on 1 of 2 ranks)" in skipped[0]
