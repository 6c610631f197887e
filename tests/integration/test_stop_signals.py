"""SIGINT / SIGTERM end a training run in one line: the step finishes (or, hung, is abandoned), a
resumable checkpoint is written, the exact resume command is printed; exit codes 130 / 143.
train_sft as a real process (Ctrl-C); train_ppo in this process, the signal sent by the run itself."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, even_reward_src, rl_flags, subprocess_env, write_rl_data

from rlhfkit.cli import train_ppo, train_sft
from rlhfkit.trainers.metrics import read_metrics

from test_run_folders import sft, write_qa


def test_ctrl_c_stops_sft_with_a_checkpoint_and_the_resume_command(tiny_model_dir, tmp_path):
    data = write_qa(tmp_path / "d.jsonl")
    out = str(tmp_path / "run")
    argv = sft(tiny_model_dir, data, out, "--max_steps", "100000", "--max_epochs", "100000")
    proc = subprocess.Popen([sys.executable, "-m", "rlhfkit.cli.train_sft", *argv], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # a few steps in
            if line.startswith("[step 3/"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    m = re.fullmatch(r"train_sft: stopped by SIGINT after step (\d+): checkpoint (\S+); resume with: (.+)", lines[0])
    assert m, lines[0]
    step, where, cmd = int(m.group(1)), m.group(2), m.group(3)
    assert where == os.path.join(out, "checkpoints", f"global_step{step}") and os.path.isdir(where)
    words = shlex.split(cmd)
    assert words[:3] == ["python", "-m", "rlhfkit.cli.train_sft"] and words[3:] == [*argv, "--load_checkpoint"]
    assert not os.path.exists(os.path.join(out, ".rlhfkit-run.lock"))  # released
    # the printed command resumes there (one more step, to keep the test short)
    history = train_sft.main(words[3:] + ["--max_steps", str(step + 1)])
    assert [h["step"] for h in history] == [step + 1]
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == list(range(1, step + 2))


# the EVEN reward; the first call of step STEP (8 samples a step) sends this process SIGTERM, then sleeps SLEEP s
SIGNAL_AT_STEP = even_reward_src(scores=False, prefix="""
import os, signal, time
SEEN = []
""", before="""    if sum(SEEN) >= 8 * (STEP - 1) and not SEEN.count(-1):
        SEEN.append(-1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(SLEEP)
    SEEN.append(len(queries))
""")


def rl_run(tmp_path, model, step: int, sleep: float, *extra: str) -> tuple[list[str], str]:
    src = SIGNAL_AT_STEP.replace("STEP", str(step)).replace("SLEEP", str(sleep))
    d = write_rl_data(str(tmp_path), num_prompts=12, reward_src=src)
    out = str(tmp_path / "out")
    # the reward runs in a thread of the trainer (--reward_workers 0): it signals the trainer's own process
    return rl_flags(model, d, out, "--num_episodes", "50", "--reward_workers", "0", *extra, steps=100), out


def test_sigterm_stops_rl_after_the_step(tiny_model_dir, tmp_path, capsys, monkeypatch):
    argv, out = rl_run(tmp_path, tiny_model_dir, 2, 0)
    monkeypatch.setattr(sys, "argv", ["/x/rlhfkit/cli/train_ppo.py", *argv])
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 143 and len(err) == 1, err
    ck = os.path.join(out, "checkpoints", "actor", "global_step2")
    assert err[0] == (f"train_ppo: stopped by SIGTERM after step 2: checkpoint {ck}; resume with: "
                      f"python -m rlhfkit.cli.train_ppo {shlex.join(argv)} --load_checkpoint")
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2]


def test_a_hung_rl_step_is_abandoned_after_the_grace_time(tiny_model_dir, tmp_path, capsys, monkeypatch):
    argv, out = rl_run(tmp_path, tiny_model_dir, 3, 8, "--stop_grace_s", "0.5")  # step 3's reward hangs
    monkeypatch.setattr(sys, "argv", ["/x/rlhfkit/cli/train_ppo.py", *argv])
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 143 and len(err) == 1, err
    ck = os.path.join(out, "checkpoints", "actor", "global_step2")
    assert err[0].startswith(f"train_ppo: stopped by SIGTERM during step 3 (abandoned after 0.5 s or a second "
                             f"signal): checkpoint {ck}; resume with: python -m rlhfkit.cli.train_ppo "), err
    assert time.monotonic() - t0 < 60
    history = train_ppo.main(argv[:-2] + ["--load_checkpoint", "--max_steps", "3"])  # the step is done again
    assert [h["step"] for h in history] == [3]
