"""Non-finite guard end to end on the tiny model: a learning rate of 1e6 ends SFT and RL with exit
code 1, one error line and no weights written; one injected non-finite RL step is skipped and the
run goes on.

On the fp32 tiny model, AdamW at 1e6 first moves every weight by ~1e6; with weight decay (`--l2`,
lr x l2 = 1e4 per step) the next steps give NaN gradients, as the issue reports (the seed SFT
command's `--packing_samples` does the same). Without them the model only saturates: finite weights
and zero gradients, which the divergence rules stop (test_divergence.py). Those rules would stop these
runs first, at the weights' growth: `--max_weight_growth 0` turns that off here, so that the non-finite
path is what runs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import DIGIT_REWARD as REWARD_FILE
from helpers import ppo_flags, pythonpath

from rlhfkit.cli import train_ppo
from rlhfkit.tasks.addition import addition_splits



def env() -> dict[str, str]:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {**os.environ, "PYTHONPATH": pythonpath(here)}


@pytest.fixture()
def rl_data(tmp_path):
    rows, _ = addition_splits(32, 2, seed=6)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input": r["input"]}) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    return tmp_path


def rl_argv(model: str, d, save: str, *extra: str) -> list[str]:
    return ppo_flags(model, str(d / "prompts.jsonl"), save, *extra, reward=str(d / "reward.py"), label_key=None,
                     train_batch_size=4, init_kl_coef=0)


def test_sft_at_learning_rate_1e6_exits_1_without_weights(tiny_model_dir, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a + 1}=", "response": str(2 * a + 1)}) + "\n"
                            for a in range(64)))
    save = str(tmp_path / "sft")
    cmd = [sys.executable, "-m", "rlhfkit.cli.train_sft", "--pretrain", tiny_model_dir, "--dataset", str(data),
           "--input_key", "question", "--output_key", "response", "--input_template", "{}", "--max_len", "32",
           "--train_batch_size", "8", "--micro_train_batch_size", "4", "--learning_rate", "1e6", "--l2", "0.01",
           "--max_steps", "8", "--max_weight_growth", "0", "--save_path", save,
           "--disable_progress", "--attn_implementation", "eager"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 1, r.stderr[-3000:]
    rows = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert [x["train/nonfinite_skipped"] for x in rows][-3:] == [1.0, 1.0, 1.0]  # 3 skipped, the 4th stopped it
    assert len(rows) < 8
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("train_sft: error: non-finite") and "--max_nonfinite_steps 3" in last
    assert "Traceback" not in r.stderr
    assert not any(f.endswith(".safetensors") for f in os.listdir(save))


def test_rl_at_learning_rate_1e6_exits_1_without_weights(tiny_model_dir, rl_data):
    save = str(rl_data / "rl")
    cmd = [sys.executable, "-m", "rlhfkit.cli.train_ppo",
           *rl_argv(tiny_model_dir, rl_data, save, "--actor_learning_rate", "1e6", "--l2", "0.01",
                    "--max_steps", "8", "--max_weight_growth", "0")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("train_ppo: error: non-finite") and "--max_nonfinite_steps 3" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not any(f.endswith(".safetensors") for f in os.listdir(save))


def test_rl_one_injected_non_finite_step_is_skipped_and_the_run_goes_on(tiny_model_dir, rl_data, monkeypatch):
    from rlhfkit.roles import actor

    calls = {"n": 0}
    real = actor.policy_loss

    def poisoned(*args, **kwargs):  # the 3rd micro-batch loss (optimizer step 2) is NaN
        loss, m = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), m) if calls["n"] == 3 else (loss, m)

    monkeypatch.setattr(actor, "policy_loss", poisoned)
    save = str(rl_data / "rl")
    train_ppo.main(rl_argv(tiny_model_dir, rl_data, save, "--actor_learning_rate", "1e-3", "--max_steps", "3"))
    rows = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert [x["step"] for x in rows] == [1, 2, 3]
    # 8 samples / --train_batch_size 4 = 2 optimizer steps per RL step: the 2nd of RL step 1 was skipped
    assert [x["train/nonfinite_skipped"] for x in rows] == [1.0, 0.0, 0.0]
    assert math.isfinite(rows[-1]["train/grad_norm"])
    assert os.path.isfile(os.path.join(save, "model.safetensors"))
