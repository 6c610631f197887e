"""User code failing under train_ppo, one sample at a time (issue 14, part 1).

- drop: a batched reward_func call that fails for some samples is retried one sample at a time, so
  only those are dropped; the survivors train with the rewards the function gives them. sys.exit()
  in the reward_func is a failure of that sample, not the end of the trainer.
- a step with nothing left to train on is skipped (`skipped_steps`, one line on stderr) and the
  run goes on; --max_failed_steps such steps in a row end it with exit code 1 and the cause.
- stop, run as a subprocess: exit code 1, exactly one line on stderr naming the file, the failing
  sample's prompt and the error, no abort; an `async def` reward_func that blocks is ended by
  --reward_timeout.
"""

from __future__ import annotations

from functools import wraps

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import ppo_flags, pythonpath

import rlhfkit
from rlhfkit.cli import train_ppo
from rlhfkit.roles.actor import ActorRole
from rlhfkit.tasks.addition import addition_splits
from rlhfkit.trainers.offline import epoch_order

N, PER_STEP, SEED = 2, 4, 42


def write_prompts(path, bad: dict[int, str] | None = None) -> list[str]:
    """8 addition prompts; `bad` maps a row to a prefix that the test reward functions refuse."""
    rows, _ = addition_splits(8, 2, seed=5)
    inputs = [(bad or {}).get(i, "") + r["input"] for i, r in enumerate(rows)]
    path.write_text("".join(json.dumps({"input": x, "label": r["label"]}) + "\n" for x, r in zip(inputs, rows)))
    return inputs


def argv(model: str, tmp_path, reward: str, *extra: str) -> list[str]:
    return ppo_flags(model, str(tmp_path / "prompts.jsonl"), str(tmp_path / "out"), "--seed", str(SEED), *extra,
                     reward=reward, n_samples_per_prompt=N, rollout_batch_size=PER_STEP,
                     train_batch_size=N * PER_STEP, micro_train_batch_size=4, max_steps=2, init_kl_coef="0.01",
                     use_kl_loss=True)


def metrics(tmp_path) -> list[dict]:
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def completion_reward(query: str, prompt: str) -> float:
    """What the reward files below give a sample that scores: depends on its own completion."""
    return sum(map(ord, query[len(prompt):])) % 7 / 7.0


REWARD = '''
import sys
LOG = {log!r}

def reward_func(queries, prompts, labels):
    with open(LOG, "a") as f:
        f.write(f"{{len(prompts)}} {{sum('x' in p or 'y' in p for p in prompts)}}\\n")
    for p in prompts:
        if "x" in p:
            raise ValueError("no verifier for this question")
        if "y" in p:
            sys.exit(3)
    return [sum(map(ord, q[len(p):])) % 7 / 7.0 for q, p in zip(queries, prompts)]
'''


def test_drop_retries_a_failing_batch_one_sample_at_a_time(tiny_model_dir, tmp_path, monkeypatch, caplog):
    inputs = write_prompts(tmp_path / "prompts.jsonl", bad={1: "x", 4: "y", 6: "x"})
    log = tmp_path / "calls.log"
    rf = tmp_path / "picky_reward.py"
    rf.write_text(REWARD.format(log=str(log)))
    seen = []
    real = ActorRole.train_on
    monkeypatch.setattr(ActorRole, "train_on", wraps(real)(lambda self, b, kl=0.0: seen.append(b) or real(self, b, kl)))
    train_ppo.main(argv(tiny_model_dir, tmp_path, str(rf), "--reward_failure", "drop"))  # default batching

    recs = metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2] and os.path.exists(tmp_path / "out" / "model.safetensors")
    assert sum(r["train/dropped_samples"] for r in recs) == 3 * N  # the samples of the 3 bad prompts, no more
    assert [r["train/skipped_steps"] for r in recs] == [0.0, 0.0]
    calls = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert any(size > 1 and bad for size, bad in calls), calls  # a batch failed and was retried
    assert "SystemExit: 3" in caplog.text and "picky_reward.py" in caplog.text
    # on the console, one line per step with drops: the count and the first failure
    summary = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "dropped" in r.getMessage()]
    assert len(summary) == 2 and all(" sample(s) dropped (--reward_failure drop); the first: " in s for s in summary)
    assert sum(int(s.split(": ")[1].split()[0]) for s in summary) == 3 * N and "picky_reward.py" in summary[0]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    trained = []
    for batch in seen:
        for i in range(batch.batch_size):
            first = int(batch.loss_mask[i].nonzero()[0])
            prompt = tok.decode(batch.input_ids[i, :first])
            query = tok.decode(batch.input_ids[i, :int(batch.attention_mask[i].sum())])
            assert batch.rewards[i].item() == pytest.approx(completion_reward(query, prompt), abs=1e-6)
            trained.append(prompt)
    assert sorted(trained) == sorted(p for p in inputs if "x" not in p and "y" not in p for _ in range(N))


def test_stop_after_max_failed_steps_in_a_row(tiny_model_dir, tmp_path, capsys):
    write_prompts(tmp_path / "prompts.jsonl")
    rf = tmp_path / "broken_reward.py"
    rf.write_text("def reward_func(queries, prompts, labels):\n    raise RuntimeError('verifier offline')\n")
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv(tiny_model_dir, tmp_path, str(rf), "--reward_failure", "drop", "--num_episodes", "2",
                            "--max_steps", "4"))
    assert e.value.code == 1
    err = capsys.readouterr().err.splitlines()
    skipped = [line for line in err if ": skipped, no trajectory to train on" in line]
    assert [line.split(":")[0] for line in skipped] == ["step 1", "step 2"]
    (last,) = [line for line in err if line.startswith("train_ppo: error:")]
    assert "3 steps in a row (--max_failed_steps 3)" in last and "step 3" in last
    assert "8 samples failed in user code" in last
    assert [r["train/skipped_steps"] for r in metrics(tmp_path)] == [1.0, 1.0]
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_one_bad_step_is_skipped_and_the_run_goes_on(tiny_model_dir, tmp_path, capsys):
    step2 = epoch_order(8, 0, SEED)[PER_STEP:2 * PER_STEP]  # the prompts of step 2
    assert set(step2) != set(epoch_order(8, 1, SEED)[:PER_STEP])  # step 3 keeps something to train on
    write_prompts(tmp_path / "prompts.jsonl", bad={i: "x" for i in step2})
    rf = tmp_path / "picky_reward.py"
    rf.write_text(REWARD.format(log=str(tmp_path / "calls.log")))
    train_ppo.main(argv(tiny_model_dir, tmp_path, str(rf), "--reward_failure", "drop", "--num_episodes", "2",
                        "--max_steps", "3"))
    recs = metrics(tmp_path)
    assert [r["train/skipped_steps"] for r in recs] == [0.0, 1.0, 0.0]
    assert recs[1]["train/dropped_samples"] == PER_STEP * N and "train/policy_loss" not in recs[1]
    assert "train/policy_loss" in recs[2] and os.path.exists(tmp_path / "out" / "model.safetensors")
    skipped = [line for line in capsys.readouterr().err.splitlines() if "skipped, no trajectory" in line]
    assert len(skipped) == 1 and skipped[0].startswith("step 2:") and "8 samples failed in user code" in skipped[0]


def test_dynamic_filtering_keeping_nothing_is_a_failed_step(tiny_model_dir, tmp_path, capsys):
    write_prompts(tmp_path / "prompts.jsonl")
    rf = tmp_path / "constant_reward.py"
    rf.write_text("def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n")
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv(tiny_model_dir, tmp_path, str(rf), "--dynamic_filtering", "--max_failed_steps", "2"))
    assert e.value.code == 1
    (last,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train_ppo: error:")]
    assert "2 steps in a row (--max_failed_steps 2)" in last and "dynamic filtering kept no group" in last


def test_sys_exit_in_reward_func_under_stop_names_the_file(tiny_model_dir, tmp_path, capsys):
    inputs = write_prompts(tmp_path / "prompts.jsonl", bad={3: "y"})
    rf = tmp_path / "exiting_reward.py"
    rf.write_text(REWARD.format(log=str(tmp_path / "calls.log")))
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv(tiny_model_dir, tmp_path, str(rf)))
    assert e.value.code == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train_ppo: error:")]
    assert str(rf) in line and "reward_func raised SystemExit: 3" in line and repr(inputs[3]) in line


# ----------------------------------------------------------------------------- as a subprocess


def run_cli(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(rlhfkit.__file__)))
    env = dict(os.environ, PYTHONPATH=pythonpath(root))
    return subprocess.run([sys.executable, "-m", "rlhfkit.cli.train_ppo", *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s)


def one_error_line(proc: subprocess.CompletedProcess, user_file: str) -> str:
    """The error line; under it only the user's own frames (`  File "<user_file>", ...` and its source line)."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("train_ppo: error: "), proc.stderr[-3000:]
    frames = lines[1::2]
    assert all(f.startswith(f'  File "{user_file}", line ') for f in frames), proc.stderr[-3000:]
    assert len(lines) == 1 + 2 * len(frames), proc.stderr[-3000:]
    return lines[0]


def test_stop_subprocess_one_line_with_the_failing_prompt(tiny_model_dir, tmp_path):
    inputs = write_prompts(tmp_path / "prompts.jsonl", bad={5: "x"})
    rf = tmp_path / "picky_reward.py"
    rf.write_text(REWARD.format(log=str(tmp_path / "calls.log")))
    proc = run_cli(argv(tiny_model_dir, tmp_path, str(rf)), timeout_s=300)
    line = one_error_line(proc, str(rf))
    assert 'in reward_func' in proc.stderr  # the user's frame is shown
    assert str(rf) in line and "ValueError: no verifier for this question" in line
    assert f"sample prompt: {inputs[5]!r}" in line  # the failing sample's, not another of its batch
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")
    log = (tmp_path / "out" / "train.log").read_text()  # the run's log file has the whole traceback
    assert "Traceback (most recent call last)" in log and "rlhfkit/agents/base.py" in log and str(rf) in log


def test_blocking_async_reward_func_is_ended_by_reward_timeout(tiny_model_dir, tmp_path):
    write_prompts(tmp_path / "prompts.jsonl")
    rf = tmp_path / "blocking_reward.py"
    rf.write_text("import time\n\nasync def reward_func(queries, prompts, labels):\n"
                  "    time.sleep(600)  # blocks its event loop\n    return [0.0] * len(queries)\n")
    t0 = time.monotonic()
    line = one_error_line(run_cli(argv(tiny_model_dir, tmp_path, str(rf), "--reward_timeout", "2"), timeout_s=300),
                          str(rf))
    assert "reward_func did not return within 2 s (--reward_timeout)" in line and str(rf) in line
    assert time.monotonic() - t0 < 120
