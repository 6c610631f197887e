"""PPO with a critic and a reward model trained by train_rm (no --remote_rm_url).

A tiny reward model is trained for 2 steps with `python -m rlhfkit.cli.train_rm` (in-process);
train_ppo then runs GAE with `--reward_pretrain RM --normalize_reward --save_value_network`.
The test recomputes every trained row's reward independently, with Hugging Face's
AutoModelForSequenceClassification on the unpadded row (score of the last token, normalised
by the mean/std train_rm stored in config.json), checks the critic started from the reward model
(--critic_pretrain defaults to it) and was trained, and that <save_path>_critic loads.
"""

from __future__ import annotations

from functools import wraps

import json
import os

import pytest
from helpers import ppo_flags
import torch

from rlhfkit.cli import train_ppo, train_rm
from rlhfkit.roles.actor import ActorRole
from rlhfkit.tasks.addition import addition_splits


@pytest.fixture(scope="module")
def reward_model(tiny_model_dir, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("rl_rm")
    rows, _ = addition_splits(16, 4, seed=2)
    prefs = os.path.join(d, "prefs.jsonl")
    with open(prefs, "w") as f:
        f.writelines(json.dumps({"prompt": r["input"], "chosen": r["output"], "rejected": r["output"][::-1] + "0"})
                     + "\n" for r in rows)
    out = os.path.join(d, "rm")
    train_rm.main(["--pretrain", tiny_model_dir, "--dataset", prefs, "--prompt_key", "prompt",
                   "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_len", "32", "--max_steps", "2",
                   "--learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--save_path", out,
                   "--run_dir", os.path.join(d, "rm_run"), "--disable_progress", "--device", "cpu"])
    return out


def test_ppo_with_critic_and_trained_reward_model(tiny_model_dir, reward_model, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    rows, _ = addition_splits(8, 4, seed=3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": r["input"]}) + "\n" for r in rows))
    seen = []
    real = ActorRole.train_on
    monkeypatch.setattr(ActorRole, "train_on", wraps(real)(lambda self, b, kl=0.0: seen.append(b) or real(self, b, kl)))
    save = str(tmp_path / "ppo")
    train_ppo.main(ppo_flags(tiny_model_dir, str(prompts), save, "--reward_pretrain", reward_model, "--normalize_reward",
                             label_key=None, advantage_estimator="gae", micro_train_batch_size=4, max_steps=2,
                             init_kl_coef="0.01", critic_learning_rate="1e-3", lr_warmup_ratio=0,
                             save_value_network=True))

    rm = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    cfg = json.load(open(os.path.join(reward_model, "config.json")))
    assert len(seen) == 2
    for batch in seen:
        want = []
        for i in range(batch.batch_size):
            n = int(batch.attention_mask[i].sum())
            with torch.no_grad():
                hidden = rm.model(input_ids=batch.input_ids[i:i + 1, :n]).last_hidden_state[0, -1]
                score = rm.score(hidden)[0]  # the head on the last token (HF's pooling looks for pad ids)
            want.append((float(score) - cfg["mean"]) / cfg["std"])
        assert batch.rewards.tolist() == pytest.approx(want, abs=1e-4)
        assert batch.values is not None and batch.values.abs().sum() > 0
    with open(os.path.join(save, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 2]
    for r, batch in zip(recs, seen):
        assert r["train/reward"] == pytest.approx(float(batch.rewards.double().mean()), abs=1e-5)
        assert r["train/value_loss"] > 0 and "train/policy_loss" in r

    critic = AutoModelForSequenceClassification.from_pretrained(save + "_critic")
    assert critic.config.architectures == ["LlamaForSequenceClassification"]
    got = load_file(os.path.join(save + "_critic", "model.safetensors"))
    start = load_file(os.path.join(reward_model, "model.safetensors"))
    assert got.keys() == start.keys()
    moved = max(float((got[k] - start[k]).abs().max()) for k in start)
    assert 1e-5 < moved < 0.1, f"critic moved {moved} from the reward model it starts from"
