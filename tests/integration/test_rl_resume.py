"""Resume from a mid-run checkpoint == the uninterrupted run (train_ppo, in-process, CPU).

PPO with a critic (gae) and the adaptive KL controller (--kl_target), so the checkpoint must
carry the policy and critic weights and optimizers, the LR schedules, the KL coefficient and the
data position; generation seeds depend only on (seed, step, sample index).

- A: 4 steps uninterrupted.
- B: the same command with --save_steps 1, crashed at the start of step 3 (an exception raised
  from the loop, after the step-2 checkpoint), then run again with --load_checkpoint.
B must log the same step-3/4 metrics as A and end with the same policy and critic weights. Both
runs execute the same float operations in the same order on CPU, so the comparison is exact up
to 1e-6 (no reduction order changes between them).
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import DIGIT_REWARD as REWARD_FILE
from helpers import ppo_flags
import torch

from rlhfkit.cli import train_ppo
from rlhfkit.tasks.addition import addition_splits
from rlhfkit.trainers.rl import RLTrainer

COMPARED = ["train/reward", "train/reward_std", "train/policy_loss", "train/value_loss", "train/kl", "train/kl_coef",
            "train/grad_norm", "train/critic_grad_norm"]


class Crash(Exception):
    pass


def argv(model: str, d, save: str, *extra: str) -> list[str]:
    return ppo_flags(model, str(d / "prompts.jsonl"), save, *extra, reward=str(d / "reward.py"), label_key=None,
                     advantage_estimator="gae", train_batch_size=4, max_steps=4, init_kl_coef="0.05",
                     kl_target="0.01", kl_horizon=20, actor_learning_rate="1e-3", critic_learning_rate="1e-3",
                     save_value_network=True)


def metrics(path: str) -> list[dict]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    rows, _ = addition_splits(16, 2, seed=6)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input": r["input"]}) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train_ppo.main(argv(tiny_model_dir, tmp_path, a))

    ckpt = ["--save_steps", "1", "--ckpt_path", str(tmp_path / "ckpt"), "--max_ckpt_num", "2"]
    real_step = RLTrainer.train_step

    def crash_at_step_3(self):
        if self.state.step == 2:
            raise Crash("killed before step 3")
        return real_step(self)

    with monkeypatch.context() as m:
        m.setattr(RLTrainer, "train_step", crash_at_step_3)
        with pytest.raises(Crash):
            train_ppo.main(argv(tiny_model_dir, tmp_path, b, *ckpt))
    assert [r["step"] for r in metrics(b)] == [1, 2]
    train_ppo.main(argv(tiny_model_dir, tmp_path, b, *ckpt, "--load_checkpoint"))

    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3, 4] == [r["step"] for r in ra]
    assert ra[2]["train/kl_coef"] != ra[0]["train/kl_coef"], "the adaptive KL coefficient never moved"
    for x, y in zip(ra, rb):
        for k in COMPARED:
            assert y[k] == pytest.approx(x[k], rel=1e-6, abs=1e-7), f"step {x['step']} {k}: {y[k]} != {x[k]}"
    for suffix in ("", "_critic"):
        wa, wb, w0 = weights(a + suffix), weights(b + suffix), weights(tiny_model_dir)
        moved = max(float((wa[k] - w0[k]).abs().max()) for k in w0 if k in wa)
        assert moved > 1e-4, f"{suffix or 'policy'} did not train"
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], atol=1e-6, rtol=0, msg=f"{suffix or 'policy'} {k}")


def test_resume_after_a_kill_between_log_and_checkpoint_logs_each_step_once(tiny_model_dir, tmp_path, monkeypatch):
    """Killed in the step-3 save (step 3 already logged): the resumed run (from step 2) truncates
    metrics.jsonl to step 2 and logs step 3 again, once; a half-written last line goes too."""
    from rlhfkit.rl_run.builders import RLCheckpointer

    rows, _ = addition_splits(16, 2, seed=6)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input": r["input"]}) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    out = str(tmp_path / "out")
    ckpt = ["--save_steps", "1", "--ckpt_path", str(tmp_path / "ckpt"), "--max_steps", "3"]
    real_save = RLCheckpointer.save

    def killed_at_3(self, root, tag, client, max_keep):
        if client["step"] == 3:
            raise Crash("killed while saving step 3")
        return real_save(self, root, tag, client, max_keep)

    with monkeypatch.context() as m:
        m.setattr(RLCheckpointer, "save", killed_at_3)
        with pytest.raises(Crash):
            train_ppo.main(argv(tiny_model_dir, tmp_path, out, *ckpt))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "rew')  # a line the kill cut short
    first_try = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.endswith("}\n")]
    assert [r["step"] for r in first_try] == [1, 2, 3]
    train_ppo.main(argv(tiny_model_dir, tmp_path, out, *ckpt, "--load_checkpoint"))
    again = metrics(out)
    assert [r["step"] for r in again] == [1, 2, 3]
    assert again[2]["train/reward"] == pytest.approx(first_try[2]["train/reward"], rel=1e-6)
