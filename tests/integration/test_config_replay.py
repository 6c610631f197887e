"""A run replayed from its run_config.json (`--config runs/x/run_config.json --save_path new`) resolves
to the same config and gives the same first-step loss; a YAML config runs train_sft end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import subprocess_env

from rlhfkit.cli import train_sft
from rlhfkit.trainers.metrics import read_metrics


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    path = tmp_path_factory.mktemp("qa") / "train.jsonl"
    with open(path, "w") as f:
        for a in range(32):
            f.write(json.dumps({"question": f"{a}+{a % 7}=", "response": str(a + a % 7)}) + "\n")
    return str(path)


def losses(run_dir: str) -> list[tuple[int, float]]:
    """(step, training loss) of each logged step (`loss`, or `train/loss` under the train/ naming)."""
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    return [(r["step"], r.get("loss", r.get("train/loss"))) for r in rows if "loss" in r or "train/loss" in r]


def first_loss(run_dir: str) -> float:
    rows = losses(run_dir)
    assert rows and rows[0][0] == 1
    return rows[0][1]


def test_replay_from_run_config_gives_the_same_first_step(tiny_model_dir, qa, tmp_path):
    first = str(tmp_path / "first")
    argv = ["--pretrain", tiny_model_dir, "--dataset", qa, "--input_key", "question", "--output_key", "response",
            "--input_template", "{}", "--max_len", "32", "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--max_steps", "1", "--param_dtype", "fp32",
            "--seed", "7", "--attn_implementation", "eager", "--save_path", first, "--disable_progress",
            "--device", "cpu"]
    train_sft.run(train_sft.build_parser().parse(argv))
    second = str(tmp_path / "second")
    train_sft.run(train_sft.build_parser().parse(["--config", os.path.join(first, "run_config.json"),
                                                  "--save_path", second]))
    a, b = (json.load(open(os.path.join(d, "run_config.json"))) for d in (first, second))
    assert b.pop("config") == os.path.join(first, "run_config.json") and a.pop("config") is None
    assert b.pop("save_path") == second and a.pop("save_path") == first
    # the default --ckpt_path lies in each run's own folder
    assert b.pop("ckpt_path") == os.path.join(second, "checkpoints") and a.pop("ckpt_path") == os.path.join(
        first, "checkpoints")
    assert a == b  # every other resolved value is the same
    assert first_loss(first) == first_loss(second)


def test_seed_changes_the_first_step(tiny_model_dir, qa, tmp_path):
    """The comparison above can fail: another seed (data order) gives another first-step loss."""
    runs = []
    for seed in ("1", "2"):
        out = str(tmp_path / f"s{seed}")
        train_sft.run(train_sft.build_parser().parse([
            "--pretrain", tiny_model_dir, "--dataset", qa, "--input_key", "question", "--output_key", "response",
            "--input_template", "{}", "--max_len", "32", "--train_batch_size", "8", "--micro_train_batch_size", "8",
            "--max_steps", "1", "--param_dtype", "fp32", "--seed", seed, "--save_path", out, "--disable_progress",
            "--device", "cpu"]))
        runs.append(first_loss(out))
    assert runs[0] != runs[1]


def test_yaml_config_runs_train_sft(tiny_model_dir, qa, tmp_path):
    pytest.importorskip("yaml")
    out = str(tmp_path / "yaml_run")
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model:\n  model_name_or_path: {tiny_model_dir}\n"
                   f"data:\n  dataset: {qa}\n  input_key: question\n  output_key: response\n"
                   "  input_template: '{}'\n  max_len: 32\n"
                   "train:\n  batch_size: 8\n  micro_batch_size: 8\n"
                   "max_steps: 1\nparam_dtype: fp32\ndisable_progress: true\ndevice: cpu\n"
                   "learning_rate: 1.0e-2\n")
    r = subprocess.run([sys.executable, "-m", "rlhfkit.cli.train_sft", "--config", str(cfg), "--save_path", out,
                        "--learning_rate", "2e-3"], capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.load(open(os.path.join(out, "run_config.json")))
    assert saved["pretrain"] == tiny_model_dir and saved["max_len"] == 32 and saved["train_batch_size"] == 8
    assert saved["learning_rate"] == 2e-3  # the command line over the file
    assert [step for step, _ in losses(out)] == [1]
