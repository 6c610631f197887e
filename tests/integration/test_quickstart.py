"""The quickstart end to end: SFT to a mediocre start, then GRPO raises held-out accuracy by >= 30 points;
reward_curve.png draws that held-out accuracy."""

import json
import os

import pytest

from rlhfkit.cli import quickstart


@pytest.mark.slow
def test_quickstart_rl_gains_30_points(tmp_path):
    run = str(tmp_path / "qs")
    quickstart.main(["--run_dir", run, "--seed", "0"])
    res = json.load(open(os.path.join(run, "results.json")))
    assert res["gain_points"] >= 30, res
    assert 0.2 <= res["accuracy_after_sft"] <= 0.6, res  # RL starts from a mediocre model, not from scratch
    assert os.path.isfile(os.path.join(run, "reward_curve.png"))
    rows = [json.loads(x) for x in open(os.path.join(run, "rl", "metrics.jsonl"))]
    rewards = [r["train/reward"] for r in rows if "train/reward" in r]
    first, last = rewards[0], sum(rewards[-3:]) / 3
    assert last > first + 0.2, (first, last)
    # the plot's held-out accuracy (eval/pass1, greedy) is the accuracy the quickstart reports
    evals = [(r["step"], r["eval/pass1"]) for r in rows if "eval/pass1" in r]
    assert evals[0] == (0, pytest.approx(res["accuracy_after_sft"]))
    assert evals[-1] == (100, pytest.approx(res["accuracy_after_rl"])) and len(evals) == 11
