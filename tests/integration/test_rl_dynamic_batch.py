"""--use_dynamic_batch (token-budget micro-batches) and --packing_samples give the same RL step as
fixed-size padded micro-batches: losses divide by global counts, so the grouping must not matter."""

import json
import os

import pytest
from helpers import length_reward_src, ppo_flags
import torch

from rlhfkit.cli import train_ppo
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.roles.actor import micro_batches
from rlhfkit.tasks.addition import addition_splits
from rlhfkit.types import ExperienceBatch


def test_token_budget_micro_batches_are_consecutive_and_within_budget():
    lengths = [5, 3, 7, 2, 2, 9]
    ids = torch.zeros(6, 9, dtype=torch.long)
    mask = torch.zeros(6, 9, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    b = ExperienceBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.clone())
    got = [(mb.batch_size, real, int(mb.attention_mask.sum())) for mb, real in micro_batches(b, 2, DistInfo(), max_tokens=10)]
    # greedy runs of consecutive rows: [5,3] [7,2] [2] [9]  (the 2 after 7+2 would overflow 10: 7+2+2=11)
    assert got == [(2, 2, 8), (2, 2, 9), (1, 1, 2), (1, 1, 9)]


def run(tmp_path, name, model, *extra):
    train, _ = addition_splits(16, 4, seed=3)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in train))
    rf = tmp_path / "rf.py"
    rf.write_text(length_reward_src())
    out = tmp_path / name
    train_ppo.main(ppo_flags(model, str(data), str(out), *extra, reward=str(rf), n_samples_per_prompt=4, train_batch_size=16,
                             micro_train_batch_size=4, micro_rollout_batch_size=4, max_steps=2, init_kl_coef="0.01",
                             use_kl_loss=True, kl_estimator="k3", actor_learning_rate="1e-3", param_dtype="fp32"))
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    from safetensors.torch import load_file

    return rows, load_file(os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("extra", [["--use_dynamic_batch", "--train_max_tokens_per_gpu", "25",
                                    "--rollout_max_tokens_per_gpu", "20"], ["--packing_samples"]])
def test_same_step_as_fixed_padded_micro_batches(tiny_model_dir, tmp_path, extra):
    base_rows, base_w = run(tmp_path, "base", tiny_model_dir)
    rows, w = run(tmp_path, "alt", tiny_model_dir, *extra)
    for a, b in zip(base_rows, rows):
        assert a["train/reward"] == pytest.approx(b["train/reward"], abs=1e-6)  # same samples
        assert a["train/policy_loss"] == pytest.approx(b["train/policy_loss"], rel=1e-4, abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    for k in base_w:
        torch.testing.assert_close(w[k], base_w[k], rtol=0, atol=2e-5, msg=k)
