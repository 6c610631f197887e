"""Failures in the user's reward_func under train_ppo: `--reward_failure stop` (default) and `drop`.

- stop: an exception, or a call running past --reward_timeout, ends the run with exit code 1 and
  one line on stderr holding the user's error and the sample's prompt; no model is saved
  (test_rl_user_failures.py runs it as a subprocess: exactly one line, the right prompt, no abort).
- drop: the run goes on; every failed sample is counted in `dropped_samples` (the reward file
  writes one line per failure, the metrics must add up to it); a group that lost a sample is left
  out whole (`incomplete_group_samples`), so the rows trained on are whole groups of one prompt.
  Reward calls are made one sample at a time here (AgentConfig.reward_batch_size = 1): a failing
  batched call drops all of its samples, and how concurrent calls merge depends on timing.
"""

from __future__ import annotations

from functools import wraps

import json
import os

import pytest
from helpers import ppo_flags

from rlhfkit.cli import train_ppo

from rlhfkit.rl_run import builders
from rlhfkit.roles.actor import ActorRole
from rlhfkit.tasks.addition import addition_splits

N, PROMPTS_PER_STEP = 2, 4


def write_prompts(path, seed: int = 5) -> list[dict]:
    rows, _ = addition_splits(8, 2, seed=seed)
    path.write_text("".join(json.dumps({"input": r["input"], "label": r["label"]}) + "\n" for r in rows))
    return rows


def argv(model: str, tmp_path, reward: str, *extra: str) -> list[str]:
    return ppo_flags(model, str(tmp_path / "prompts.jsonl"), str(tmp_path / "out"), *extra, reward=reward,
                     n_samples_per_prompt=N, rollout_batch_size=PROMPTS_PER_STEP,
                     train_batch_size=N * PROMPTS_PER_STEP, micro_train_batch_size=4, max_steps=2,
                     init_kl_coef="0.01", use_kl_loss=True)


def stopped_with(capsys, argv_: list[str]) -> str:
    """Run train_ppo expecting exit code 1; returns its error line."""
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv_)
    assert e.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train_ppo: error:")]
    assert len(err) == 1, err
    return err[0]


def test_raising_reward_func_stops_the_run(tiny_model_dir, tmp_path, capsys):
    rows = write_prompts(tmp_path / "prompts.jsonl")
    rf = tmp_path / "bad_reward.py"
    rf.write_text("def reward_func(queries, prompts, labels):\n"
                  "    raise ValueError('reward service exploded on ' + repr(prompts[0]))\n")
    msg = stopped_with(capsys, argv(tiny_model_dir, tmp_path, str(rf)))
    assert "reward service exploded on" in msg and "ValueError" in msg and "bad_reward.py" in msg
    shown = msg.split("sample prompt:")[1]
    assert any(repr(r["input"]) in shown for r in rows), msg
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_reward_timeout_stops_the_run(tiny_model_dir, tmp_path, capsys):
    write_prompts(tmp_path / "prompts.jsonl")
    rf = tmp_path / "slow_reward.py"
    rf.write_text("import time\n\ndef reward_func(queries, prompts, labels):\n    time.sleep(3)\n"
                  "    return [0.0] * len(queries)\n")
    msg = stopped_with(capsys, argv(tiny_model_dir, tmp_path, str(rf), "--reward_timeout", "0.3"))
    assert "did not return within 0.3 s (--reward_timeout)" in msg


DROP_REWARD = '''
MARK, LOG = {mark!r}, {log!r}

def reward_func(queries, prompts, labels):
    completion = queries[0][len(prompts[0]):]
    if labels[0] == MARK or ord(completion[0]) % 8 == 0:
        with open(LOG, "a") as f:
            f.write(prompts[0] + "\\n")
        raise RuntimeError("cannot score " + prompts[0])
    return {{"rewards": [len(completion) / 10.0], "scores": [1.0]}}
'''


def test_drop_counts_failed_samples_and_keeps_whole_groups(tiny_model_dir, tmp_path, monkeypatch):
    rows = write_prompts(tmp_path / "prompts.jsonl")
    mark, log = rows[0]["label"], str(tmp_path / "failures.log")
    rf = tmp_path / "flaky_reward.py"
    rf.write_text(DROP_REWARD.format(mark=mark, log=log))
    real_cfg = builders.agent_config

    def one_sample_calls(args, temperature):
        cfg = real_cfg(args, temperature)
        cfg.reward_batch_size = 1
        return cfg

    monkeypatch.setattr(builders, "agent_config", one_sample_calls)
    seen = []
    real = ActorRole.train_on
    monkeypatch.setattr(ActorRole, "train_on", wraps(real)(lambda self, b, kl=0.0: seen.append(b) or real(self, b, kl)))
    train_ppo.main(argv(tiny_model_dir, tmp_path, str(rf), "--reward_failure", "drop"))

    with open(tmp_path / "out" / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    with open(log) as f:
        failed = f.read().splitlines()
    assert [r["step"] for r in recs] == [1, 2] and os.path.exists(tmp_path / "out" / "model.safetensors")
    assert sum(r["train/dropped_samples"] for r in recs) == len(failed)
    assert failed.count(rows[0]["input"]) == N  # the marked prompt is in one of the 2 steps (8 prompts, 4 a step)
    incomplete = [r.get("train/incomplete_group_samples", 0) for r in recs]
    assert sum(incomplete) > 0, "no group lost just one sample: pick another failure rule"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for rec, batch, inc in zip(recs, seen, incomplete):
        assert batch.batch_size + rec["train/dropped_samples"] + inc == N * PROMPTS_PER_STEP
        assert batch.batch_size % N == 0
        prompts = []
        for i in range(batch.batch_size):
            first = int(batch.loss_mask[i].nonzero()[0])
            prompts.append(tok.decode(batch.input_ids[i, :first]))
        assert all(len(set(prompts[g:g + N])) == 1 for g in range(0, len(prompts), N)), prompts
        assert rows[0]["input"] not in prompts
