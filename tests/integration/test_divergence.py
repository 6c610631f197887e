"""Divergence guard end to end on the tiny model: a learning rate of 1e6 stops SFT, RM, DPO, KTO and PPO
with exit code 1, one error line naming the flag, and no model or checkpoint written from the ruined
weights.

Without weight decay, one AdamW step at 1e6 moves every weight by about 1e6 and the network saturates:
finite weights, gradients exactly 0 from the next step on, a loss that stays (what the runs did before:
exit 0, the wreck saved as the model). The weight-growth rule (--max_weight_growth) stops the run at
the step that made the weights explode, before the checkpoint of that step; with it off, the zero-gradient
rule (--max_zero_grad_steps) stops it a few steps later.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import ppo_flags, write_rl_data

from rlhfkit.cli import train_dpo, train_kto, train_ppo, train_rm, train_sft

COMMON = ["--max_len", "32", "--train_batch_size", "8", "--micro_train_batch_size", "4", "--lr_warmup_ratio", "0",
          "--lr_scheduler", "constant", "--disable_progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("divergence_data")
    sums = [(a, b) for a in range(4) for b in range(4)]
    rows = {
        "sft.jsonl": [{"input": f"{a}+{b}=", "output": str(a + b)} for a, b in sums],
        "pairs.jsonl": [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in sums],
        "kto.jsonl": [{"input": f"{a}+{b}=", "output": str(a + b + k), "label": k == 0} for a, b in sums
                      for k in (0, 1)],
    }
    for name, rs in rows.items():
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rs))
    write_rl_data(str(d), num_prompts=8)
    return d


def argv(trainer: str, model: str, d, save: str, *extra: str) -> list[str]:
    pairs = ["--dataset", str(d / "pairs.jsonl"), "--prompt_key", "prompt", "--chosen_key", "chosen",
             "--rejected_key", "rejected"]
    data = {"sft": ["--dataset", str(d / "sft.jsonl"), "--input_key", "input", "--output_key", "output"],
            "rm": pairs, "dpo": pairs,
            "kto": ["--dataset", str(d / "kto.jsonl"), "--input_key", "input", "--output_key", "output",
                    "--label_key", "label"]}
    if trainer == "ppo":  # PPO proper: GAE with a critic, one optimizer step per RL step
        return ppo_flags(model, str(d / "prompts.jsonl"), save, "--actor_learning_rate", "1e6", "--lr_warmup_ratio",
                         "0", *extra, reward=str(d / "reward.py"), advantage_estimator="gae", micro_train_batch_size=8)
    return ["--pretrain", model, *data[trainer], *COMMON, "--input_template", "{}", "--learning_rate", "1e6",
            "--save_path", save, *extra]


MAINS = {"sft": train_sft.main, "rm": train_rm.main, "dpo": train_dpo.main, "kto": train_kto.main,
         "ppo": train_ppo.main}


def run_stopped(trainer: str, model: str, d, save: str, capsys, *extra: str) -> str:
    """Run `trainer` at learning rate 1e6; it must exit 1; its last stderr line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        MAINS[trainer](argv(trainer, model, d, save, *extra))
    err = capsys.readouterr().err
    assert e.value.code == 1, err[-3000:]
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def weight_files(save: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(p, f), save) for p, _, fs in os.walk(save) for f in fs
                  if f.endswith((".safetensors", ".distcp")))


@pytest.mark.parametrize("trainer", ["sft", "rm", "dpo", "kto", "ppo"])
def test_learning_rate_1e6_stops_every_trainer_with_nothing_saved(tiny_model_dir, data, tmp_path, capsys, trainer):
    save = str(tmp_path / trainer)
    last = run_stopped(trainer, tiny_model_dir, data, save, capsys, "--max_steps", "4", "--save_steps", "1")
    prog = "train_" + trainer
    assert last.startswith(f"{prog}: error: weights diverged after optimizer step 1 (grad norm "), last
    assert "learning rate 1e+06): the largest |weight| is " in last and "more than --max_weight_growth 100 x " in last
    assert last.endswith("stopping without saving; lower the learning rate and resume from a checkpoint saved before "
                         "this"), last
    assert weight_files(save) == []  # neither the final model nor the step-1 checkpoint of the ruined weights


def test_with_the_growth_rule_off_zero_gradients_stop_the_run(tiny_model_dir, data, tmp_path, capsys):
    save = str(tmp_path / "dpo")
    last = run_stopped("dpo", tiny_model_dir, data, save, capsys, "--max_steps", "8", "--max_weight_growth", "0")
    assert last.startswith("train_dpo: error: the gradient was exactly 0 while the loss was not in 4 optimizer steps "
                           "in a row, up to step 5 (more than --max_zero_grad_steps 3; learning rate 1e+06): the model "
                           "no longer learns"), last
    rows = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert [r["train/grad_norm"] > 0 for r in rows] == [True, False, False, False]  # step 5 raised before its log
    assert weight_files(save) == []
