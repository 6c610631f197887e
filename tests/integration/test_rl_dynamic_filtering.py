"""Dynamic filtering that removes every group (issue 15, part 6), under train_ppo.

A reward_func that gives every sample 1.0 makes every group's mean score 1.0, outside the open
--dynamic_filtering_reward_range (0, 1): nothing can pass. Each step then draws --max_filter_rounds
batches of prompts (`filter_rounds`; the reward_func's log counts them), never the same prompt
twice in one step (not even where a step's rounds run into the next episode), and is skipped
(`skipped_steps` = 1, one stderr line); the run goes on and ends normally unless --max_failed_steps
steps in a row were skipped. The data cursor moved by the refill rounds is saved with a checkpoint:
a run resumed after step 1 draws the same prompts in step 2 as the uninterrupted run.

8 prompts, 2 per batch, 3 rounds: step 1 draws positions 0-5 of episode 0's order; step 2 draws
positions 6-7, then (episode 1) the first 4 prompts of its order that step 2 has not drawn yet.
"""

from __future__ import annotations

import json

import pytest
from helpers import ppo_flags

from rlhfkit.cli import train_ppo
from rlhfkit.tasks.addition import addition_splits
from rlhfkit.trainers.offline import epoch_order

N, PER_STEP, ROUNDS, SEED = 2, 2, 3, 42

REWARD = '''
LOG = {log!r}

def reward_func(queries, prompts, labels):
    with open(LOG, "a") as f:
        f.writelines(p.replace("\\n", " ") + "\\n" for p in prompts)
    return {{"rewards": [1.0] * len(queries), "scores": [1.0] * len(queries)}}
'''


def setup(tmp_path) -> tuple[list[str], str]:
    rows, _ = addition_splits(8, 2, seed=5)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rf = tmp_path / "always_one.py"
    rf.write_text(REWARD.format(log=str(tmp_path / "prompts.log")))
    return [r["input"].replace("\n", " ") for r in rows], str(rf)


def argv(model: str, tmp_path, reward: str, out: str, *extra: str) -> list[str]:
    return ppo_flags(model, str(tmp_path / "prompts.jsonl"), str(tmp_path / out), "--seed", str(SEED),
                     "--num_episodes", "3", *extra, reward=reward, n_samples_per_prompt=N, rollout_batch_size=PER_STEP,
                     train_batch_size=N * PER_STEP, generate_max_len=4, init_kl_coef=0, dynamic_filtering=True,
                     dynamic_filtering_reward_range=(0, 1), max_filter_rounds=ROUNDS)


def records(path) -> list[dict]:
    with open(path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def drawn_per_step(tmp_path, steps: int) -> list[list[str]]:
    """The prompts the reward_func saw, per step (each prompt N times per round)."""
    lines = (tmp_path / "prompts.log").read_text().splitlines()
    assert len(lines) == steps * ROUNDS * PER_STEP * N, len(lines)
    per = ROUNDS * PER_STEP * N
    return [sorted(set(lines[i * per:(i + 1) * per])) for i in range(steps)]


def test_rounds_then_skipped_step_and_the_run_goes_on(tiny_model_dir, tmp_path, capsys):
    inputs, rf = setup(tmp_path)
    train_ppo.main(argv(tiny_model_dir, tmp_path, rf, "out", "--max_steps", "2", "--max_failed_steps", "3"))
    recs = records(tmp_path / "out")
    assert [r["step"] for r in recs] == [1, 2]
    assert [r["train/filter_rounds"] for r in recs] == [ROUNDS, ROUNDS]
    assert [r["train/skipped_steps"] for r in recs] == [1.0, 1.0]
    assert all(r["train/dynamic_filtering_pass_rate"] == 0.0 and "train/policy_loss" not in r for r in recs)
    assert (tmp_path / "out" / "model.safetensors").exists()  # the run ended normally
    err = [line for line in capsys.readouterr().err.splitlines() if "skipped, no trajectory" in line]
    assert len(err) == 2 and all(f"kept no group in {ROUNDS} rounds (--max_filter_rounds {ROUNDS}" in e for e in err)

    # every round drew new prompts: ROUNDS x PER_STEP distinct prompts per step
    step1, step2 = drawn_per_step(tmp_path, 2)
    assert len(step1) == len(step2) == ROUNDS * PER_STEP
    # the rounds follow the episode orders; step 2 crosses into episode 1 and skips what it already drew
    order0, order1 = epoch_order(8, 0, SEED), epoch_order(8, 1, SEED)
    assert step1 == sorted(inputs[i] for i in order0[:6])
    tail = order0[6:]
    assert step2 == sorted(inputs[i] for i in tail + [i for i in order1 if i not in tail][:4])
    assert set(order1[:4]) & set(tail), "the orders were meant to overlap here (else nothing is tested)"


def test_max_failed_steps_still_ends_the_run(tiny_model_dir, tmp_path, capsys):
    _, rf = setup(tmp_path)
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv(tiny_model_dir, tmp_path, rf, "out", "--max_steps", "4", "--max_failed_steps", "2"))
    assert e.value.code == 1
    (last,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train_ppo: error:")]
    assert "2 steps in a row (--max_failed_steps 2)" in last and f"kept no group in {ROUNDS} rounds" in last
    assert [r["train/filter_rounds"] for r in records(tmp_path / "out")] == [ROUNDS]  # step 2 raised before logging


def test_cursor_after_refill_rounds_resumes_at_the_same_prompt(tiny_model_dir, tmp_path):
    _, rf = setup(tmp_path)
    train_ppo.main(argv(tiny_model_dir, tmp_path, rf, "full", "--max_steps", "2"))
    full = drawn_per_step(tmp_path, 2)
    (tmp_path / "prompts.log").unlink()
    ckpt = str(tmp_path / "ckpt")
    train_ppo.main(argv(tiny_model_dir, tmp_path, rf, "part", "--max_steps", "1", "--save_steps", "1",
                        "--ckpt_path", ckpt))
    (tmp_path / "prompts.log").unlink()
    train_ppo.main(argv(tiny_model_dir, tmp_path, rf, "part", "--max_steps", "2", "--save_steps", "1",
                        "--ckpt_path", ckpt, "--load_checkpoint"))
    assert drawn_per_step(tmp_path, 1) == [full[1]]
    assert [r["step"] for r in records(tmp_path / "part")] == [1, 2]
