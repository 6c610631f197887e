"""A reward_func that never returns cannot hang a run (issue 42.5).

The function is stuck in one C call that holds the GIL (a regular expression that backtracks for 2^40
steps): in a thread of the trainer no time limit could fire, the trainer's own loop never runs again.
By default a reward_func file runs in worker processes, and `--reward_timeout 5` ends it:

- `--reward_failure stop`: the run ends with exit code 1 and one line naming the file and the time limit,
  within 15 s of the first reward call;
- `--reward_failure drop` (one prompt of step 1 hangs): the step ends within 15 s with that prompt's samples
  dropped (with as many stuck samples as worker processes, the batch's other samples too: the retries of a
  batch end within one more time limit), and step 2 trains at full speed: the stuck workers were killed,
  nothing is left spinning.

Both run as subprocesses, at once (their time is mostly the time limit): a trainer that hangs is killed
by the test's own time limit and the test fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from helpers import pythonpath
from test_rl_user_failures import N, PER_STEP, SEED, argv, write_prompts

import rlhfkit
from rlhfkit.trainers.offline import epoch_order

STUCK = '''
import re, time

def reward_func(queries, prompts, labels):
    with open({log!r}, "a") as f:
        f.write(f"{{time.time()}}\\n")
    if any({marker!r} in p for p in prompts):
        re.match(r"(a+)+$", "a" * 40 + "b")  # one C call, holding the GIL, for 2^40 steps
    return [len(q) % 3 / 2.0 for q in queries]
'''


def start(tmp_path, marker: str, *extra: str) -> subprocess.Popen:
    tmp_path.mkdir(exist_ok=True)
    write_prompts(tmp_path / "prompts.jsonl", bad={i: "x" for i in epoch_order(8, 0, SEED)[:1]})
    rf = tmp_path / "stuck_reward.py"
    rf.write_text(STUCK.format(log=str(tmp_path / "calls.log"), marker=marker))
    root = os.path.dirname(os.path.dirname(os.path.abspath(rlhfkit.__file__)))
    env = dict(os.environ, PYTHONPATH=pythonpath(root))
    args = argv(os.environ["TINY_MODEL"], tmp_path, str(rf), "--reward_timeout", "5", *extra)
    return subprocess.Popen([sys.executable, "-m", "rlhfkit.cli.train_ppo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen, limit_s: float) -> tuple[int, str, float]:
    """(exit code, stderr, the time it ended); a run still going after `limit_s` is killed: the test fails."""
    try:
        _, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"the run did not end within {limit_s} s: the stuck reward_func hangs it") from None
    return proc.returncode, err, time.time()


def test_a_gil_holding_reward_func_ends_the_run_or_its_step(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TINY_MODEL", tiny_model_dir)
    stop = start(tmp_path / "stop", "+", "--max_steps", "1")  # every prompt has a '+': every call hangs
    drop = start(tmp_path / "drop", "x", "--reward_failure", "drop")  # one prompt of step 1 hangs (2 steps)
    try:
        check(tmp_path, stop, drop)
    finally:
        for proc in (stop, drop):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def check(tmp_path, stop: subprocess.Popen, drop: subprocess.Popen) -> None:
    code, err, ended = finish(stop, 60)
    rf = tmp_path / "stop" / "stuck_reward.py"
    (line,) = [x for x in err.splitlines() if x.startswith("train_ppo: error:")]
    assert code == 1 and f"{rf}: reward_func did not return within 5 s (--reward_timeout); its worker process " \
                          "was killed" in line, err[-3000:]
    first_call = float((tmp_path / "stop" / "calls.log").read_text().split()[0])
    assert ended - first_call < 15, ended - first_call
    assert "Traceback" not in err, err[-3000:]

    code, err, _ = finish(drop, 60)
    assert code == 0, err[-3000:]
    one, two = [json.loads(x) for x in (tmp_path / "drop" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert N <= one["train/dropped_samples"] <= N * PER_STEP and one["time/step"] < 15, one
    assert two["train/dropped_samples"] == 0 and "train/policy_loss" in two and two["time/step"] < 5, two
    assert "did not return within 5 s (--reward_timeout); its worker process was killed" in err
