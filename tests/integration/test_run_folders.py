"""Runs never mix (train_sft on the tiny model): a second run into a folder holding a finished run is
refused in one line; checkpoints live in the run's own folder; --load_checkpoint of another run's
checkpoint with other settings is refused naming the flags, and a deliberate change takes effect."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rlhfkit.checkpoint.layout import list_checkpoints
from rlhfkit.cli import train_sft
from rlhfkit.runs.directory import LOCK
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


def checkpoint_tags(folder) -> list[str]:
    return [tag for _, tag in list_checkpoints(str(folder))]


def test_overwrite_with_ckpt_path_at_save_path_keeps_the_users_files(tiny_model_dir, tmp_path, capsys):
    """Issue #42, 1: --overwrite_output_dir removes what the earlier run wrote, never the user's own files."""
    data = write_qa(tmp_path / "d.jsonl")
    out = tmp_path / "same"
    train_sft.main(sft(tiny_model_dir, data, str(out), "--ckpt_path", str(out), "--save_steps", "2"))
    (out / "NOTES.txt").write_text("my notes")
    os.makedirs(out / "mydata")
    (out / "mydata" / "rows.jsonl").write_text("{}\n")
    capsys.readouterr()
    train_sft.main(sft(tiny_model_dir, data, str(out), "--ckpt_path", str(out), "--save_steps", "2",
                       "--overwrite_output_dir", "--seed", "3"))
    assert (out / "NOTES.txt").read_text() == "my notes" and (out / "mydata" / "rows.jsonl").read_text() == "{}\n"
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [1, 2]  # the new run only
    assert json.load(open(out / "run_config.json"))["seed"] == 3 and checkpoint_tags(out) == ["global_step2"]
    assert not (out / LOCK).exists()  # released at the end, as ever
    assert "and checkpoints global_step2, latest from --ckpt_path " in capsys.readouterr().out


def test_a_live_runs_folder_is_never_shared_until_it_is_killed(tiny_model_dir, tmp_path, capsys):
    """Issue #42, 2: while run A trains into lk/, a run B with --ckpt_path or --save_path inside it is refused
    in one line naming A (pid, command); once A is killed (kill -9: its lock stays behind), B is allowed.
    A's pid is the one its lock names (under tests/warmstart that process is not the client Popen started)."""
    data = write_qa(tmp_path / "d.jsonl")
    lk, b = tmp_path / "lk", str(tmp_path / "b")
    ck = str(lk / "checkpoints")
    a_argv = sft(tiny_model_dir, data, str(lk), "--max_steps", "100000", "--max_epochs", "100000", "--save_steps", "1")
    with open(tmp_path / "a.log", "w") as log:
        a = subprocess.Popen([sys.executable, "-m", "rlhfkit.cli.train_sft", *a_argv], stdout=log, stderr=log)
    try:
        deadline = time.time() + 120
        while not list_checkpoints(ck):
            assert a.poll() is None and time.time() < deadline, (tmp_path / "a.log").read_text()
            time.sleep(0.1)
        a_lock = json.load(open(lk / LOCK))
        assert a_lock["command"].startswith("python -m rlhfkit.cli.train_sft --pretrain ")
        live = (f"the folder of a live run (pid {a_lock['pid']} on {socket.gethostname()}, started "
                f"{a_lock['started']}, command: {a_lock['command']}): wait for it to end or choose another")
        capsys.readouterr()
        for b_argv, flag, folder in [(sft(tiny_model_dir, data, b, "--ckpt_path", ck, "--load_checkpoint"),
                                      "--ckpt_path", ck),
                                     (sft(tiny_model_dir, data, b, "--ckpt_path", ck), "--ckpt_path", ck),
                                     (sft(tiny_model_dir, data, ck), "--save_path", ck)]:
            with pytest.raises(SystemExit) as e:
                train_sft.main(b_argv)
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 1 and err == [f"train_sft: error: {flag} {folder} is inside {lk}, {live} {flag}"]
        assert not os.path.exists(b)  # B made nothing, and wrote nothing into A's folder:
        assert not [n for n in (LOCK, "metrics.jsonl", "run_config.json", "config.json") if os.path.exists(f"{ck}/{n}")]
        assert a.poll() is None  # and A trains on
        os.kill(a_lock["pid"], signal.SIGKILL)
        a.wait()
        while os.path.exists(f"/proc/{a_lock['pid']}"):  # reaped (by its parent)
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        a.kill()
        a.wait()
    assert json.load(open(lk / LOCK)) == a_lock  # a kill -9 leaves its lock behind
    step = int(checkpoint_tags(ck)[-1].removeprefix("global_step"))
    history = train_sft.main(sft(tiny_model_dir, data, b, "--ckpt_path", ck, "--load_checkpoint",
                                 "--max_steps", str(step + 1)))
    assert [h["step"] for h in history] == [step + 1]  # resumed from A's newest checkpoint
    train_sft.main(sft(tiny_model_dir, data, ck))
    assert os.path.isfile(os.path.join(ck, "config.json"))
    capsys.readouterr()
    history = train_sft.main(sft(tiny_model_dir, data, str(lk), "--load_checkpoint", "--max_steps", str(step + 1)))
    assert [h["step"] for h in history] == [step + 1]  # A's own folder: its stale lock taken over
    assert f"taking over the lock of a run that ended without releasing it (pid {a_lock['pid']}" in \
        capsys.readouterr().out
