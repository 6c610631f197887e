"""Runs never mix (train_sft on the tiny model): a second run into a folder holding a finished run is
refused in one line; checkpoints live in the run's own folder; --load_checkpoint of another run's
checkpoint with other settings is refused naming the flags, and a deliberate change takes effect."""

from __future__ import annotations

import json
import os

import pytest

from rlhfkit.cli import train_sft
from rlhfkit.trainers.metrics import read_metrics


def write_qa(path, n: int = 64) -> str:
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 9, (i * 7) % 11
            f.write(json.dumps({"q": f"{a}+{b}=", "a": str(a + b)}) + "\n")
    return str(path)


def sft(model, data, out, *extra):
    return ["--pretrain", model, "--dataset", data, "--input_key", "q", "--output_key", "a", "--input_template", "{}",
            "--max_len", "32", "--train_batch_size", "8", "--micro_train_batch_size", "8", "--max_steps", "2",
            "--learning_rate", "1e-3", "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
            "--param_dtype", "fp32", "--save_path", out, "--disable_progress", "--device", "cpu", *extra]


def test_a_finished_run_is_not_appended_to(tiny_model_dir, tmp_path, capsys):
    data = write_qa(tmp_path / "d.jsonl")
    out = str(tmp_path / "run")
    train_sft.main(sft(tiny_model_dir, data, out, "--save_steps", "2"))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["global_step2", "latest"]  # in the run's own folder
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_sft.main(sft(tiny_model_dir, data, out))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err == [
        f"train_sft: error: --save_path {out} holds an earlier run (2 logged steps in {out}/metrics.jsonl; a saved "
        f"model in {out}; checkpoints in {out}/checkpoints): resume it with --load_checkpoint, start over with "
        "--overwrite_output_dir, or choose another --save_path"]
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2]
    train_sft.main(sft(tiny_model_dir, data, out, "--overwrite_output_dir", "--seed", "3"))
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2]  # the new run only
    assert json.load(open(os.path.join(out, "run_config.json")))["seed"] == 3


def test_another_runs_checkpoint_with_other_settings_is_refused_then_changed_deliberately(tiny_model_dir, tmp_path,
                                                                                         capsys):
    data = write_qa(tmp_path / "d.jsonl")
    first = str(tmp_path / "first")
    train_sft.main(sft(tiny_model_dir, data, first, "--save_steps", "2"))
    ck = os.path.join(first, "checkpoints")
    second = str(tmp_path / "second")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_sft.main(sft(tiny_model_dir, data, second, "--ckpt_path", ck, "--load_checkpoint", "--max_steps", "3",
                           "--learning_rate", "2e-3", "--train_batch_size", "16"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"train_sft: error: --load_checkpoint: the checkpoint in --ckpt_path {ck} was made by a run with other "
        "settings: --train_batch_size 8 (now 16); --learning_rate 0.001 (now 0.002)."), err
    history = train_sft.main(sft(tiny_model_dir, data, second, "--ckpt_path", ck, "--load_checkpoint",
                                 "--max_steps", "3", "--learning_rate", "2e-3",
                                 "--allow_resume_changes", "learning_rate"))
    assert [h["step"] for h in history] == [3]
    assert history[0]["train/lr"] == pytest.approx(2e-3, rel=1e-9)  # this run's rate, not the checkpoint's
