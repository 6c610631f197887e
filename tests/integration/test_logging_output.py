"""What a run leaves for its user: a log without progress bars when output goes to a file (one line per
logged step and per evaluation), one metric naming scheme in metrics.jsonl and TensorBoard, the plot,
and a model card in the saved model (train_sft and train_ppo on the tiny model, as subprocesses)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import rl_flags, subprocess_env, write_rl_data

from rlhfkit.trainers.metrics import read_metrics


def write_qa(path: str, n: int) -> str:
    with open(path, "w") as f:
        for i in range(n):
            a, b = (7 * i) % 50, (3 * i + 1) % 50
            f.write(json.dumps({"question": f"{a}+{b}=", "response": str(a + b)}) + "\n")
    return path


def run_logged(tmp_path, module: str, args: list[str]) -> str:
    """Run `module` with stdout and stderr redirected to one file (no terminal); returns the file's text."""
    log = tmp_path / f"{module}.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", f"rlhfkit.cli.{module}", *args], stdout=f, stderr=subprocess.STDOUT,
                           env=subprocess_env(), timeout=300)
    text = log.read_text()
    assert r.returncode == 0, text[-3000:]
    return text


def step_lines(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^\[step (\d+)/\d+\] ", text, flags=re.M)]


def eval_lines(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^\[eval step (\d+)\] ", text, flags=re.M)]


def test_sft_log_tensorboard_plot_and_model_card(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, out, tb = write_qa(str(tmp_path / "qa.jsonl"), 96), str(tmp_path / "sft"), str(tmp_path / "tb")
    text = run_logged(tmp_path, "train_sft", [
        "--pretrain", tiny_model_dir, "--dataset", data, "--eval_dataset", data, "--input_key", "question",
        "--output_key", "response", "--input_template", "{}", "--max_len", "32", "--train_batch_size", "16",
        "--micro_train_batch_size", "8", "--max_steps", "6", "--logging_steps", "2", "--eval_steps", "3",
        "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--save_path", out, "--use_tensorboard", tb,
        "--save_steps", "3", "--save_hf_ckpt", "--disable_ds_ckpt", "--ckpt_path", str(tmp_path / "ckpt")])
    assert "\r" not in text
    # bars would be on (no --disable_progress), but the output is a file: plain lines instead
    assert step_lines(text) == [2, 3, 4, 6] and eval_lines(text) == [3, 6]  # step 3: logged for its evaluation
    assert "Loading weights" not in text and "Writing model shards" not in text  # no third-party bars
    run_log = open(os.path.join(out, "train.log")).read()  # the run's log file: the same lines, with times
    assert "\x1b[" not in run_log and " INFO rlhfkit.trainers.metrics: [step 6/6] loss=" in run_log
    line = next(x for x in text.splitlines() if x.startswith("[step 2/6]"))
    assert re.fullmatch(r"\[step 2/6\] loss=\S+ grad_norm=\S+ lr=\S+ \(\S+ s/step\)", line), line

    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [2, 3, 4, 6]
    names = {k for r in rows for k in r if k != "step"}
    assert {"train/loss", "train/grad_norm", "train/lr", "eval/loss"} <= names
    assert all(k.startswith(("train/", "eval/", "data/")) for k in names), names  # data/: what reading the data cut

    runs = os.listdir(tb)  # one TensorBoard run folder per training run, named after the run directory
    assert len(runs) == 1 and re.fullmatch(r"sft_\d{8}-\d{6}", runs[0]), runs
    assert f"TensorBoard: {os.path.join(tb, runs[0])}" in text
    acc = EventAccumulator(os.path.join(tb, runs[0]))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == names  # TensorBoard's tags are metrics.jsonl's names
    tb_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert tb_loss == [(r["step"], pytest.approx(r["train/loss"], rel=1e-6)) for r in rows if "train/loss" in r]
    assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6]
    assert os.path.getsize(os.path.join(out, "metrics.png")) > 10_000

    card = open(os.path.join(out, "README.md")).read()
    assert card.startswith("---\nlibrary_name: rlhfkit\n") and "- sft\n" in card
    assert f"| base model | `{tiny_model_dir}` |" in card and f"`{data}`" in card
    assert "python -m rlhfkit.cli.train_sft --pretrain " in card and "--max_steps 6" in card
    last_loss = [r["train/loss"] for r in rows if "train/loss" in r][-1]
    assert f"| `train/loss` | {last_loss:.6g} | 6 |" in card
    assert f"| `eval/loss` | {rows[-1]['eval/loss']:.6g} | 6 |" in card
    snap = open(tmp_path / "ckpt" / "global_step3_hf" / "README.md").read()  # a --save_hf_ckpt snapshot's card
    assert "- sft\n" in snap and "a snapshot at step 3" in snap
    assert f"| `train/loss` | {rows[1]['train/loss']:.6g} | 3 |" in snap and "| 6 |" not in snap


def test_ppo_log_without_bars_and_model_card(tiny_model_dir, tmp_path):
    d = write_rl_data(str(tmp_path))
    out = str(tmp_path / "rl")
    flags = [f for f in rl_flags(tiny_model_dir, d, out, steps=3) if f != "--disable_progress"]
    text = run_logged(tmp_path, "train_ppo", [*flags, "--eval_dataset", os.path.join(d, "prompts.jsonl"),
                                              "--eval_steps", "2", "--eval_n_samples_per_prompt", "2"])
    assert "\r" not in text
    assert step_lines(text) == [1, 2, 3] and eval_lines(text) == [0, 2, 3]
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    line = next(x for x in text.splitlines() if x.startswith("[step 1/3]"))
    assert f"reward={rows[1]['train/reward']:.4g} " in line and line.endswith(" s/step)")
    assert set(rows[0]) == {"step", "eval/reward", "eval/pass1", "eval/pass2"}
    assert all(k.startswith(("train/", "eval/", "time/")) for r in rows for k in r if k != "step")
    card = open(os.path.join(out, "README.md")).read()
    assert "- reinforcement-learning\n" in card and "| `advantage_estimator` | `group_norm` |" in card
    assert f"| `train/reward` | {rows[-1]['train/reward']:.6g} | 3 |" in card
    assert os.path.getsize(os.path.join(out, "metrics.png")) > 10_000
