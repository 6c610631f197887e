"""The quickstart end to end: SFT to a mediocre start, then GRPO raises held-out accuracy by >= 30 points."""

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
    first, last = rows[0]["train/reward"], sum(r["train/reward"] for r in rows[-3:]) / 3
    assert last > first + 0.2, (first, last)
