"""bench/grpo_real.py's pieces that decide its figures, by hand: the questions, the reward both sides use, the
headline comparisons, the smoke defaults, and the merge of two processes' records into one JSON."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.* imports from here


@pytest.fixture(scope="module")
def gr():
    sys.path.insert(0, ROOT)
    env = dict(os.environ)
    try:
        module = importlib.import_module("bench.grpo_real")
        # what the bench sets for its own runs on import (HF_DATASETS_OFFLINE ...: the tests are offline already) would
        # give the processes this worker starts another import environment (tests/conftest.py: _import_env_kept)
        os.environ.clear()
        os.environ.update(env)
        yield module
    finally:
        sys.path.remove(ROOT)


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_questions_are_disjoint_two_digit_sums(gr):
    train, held = gr.addition_questions(300, 50, seed=3)
    assert len(train) == 300 and len(held) == 50
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert len({r["question"] for r in train}) == 300
    for r in train + held:
        a, b = r["question"].removeprefix("What is ").split("?")[0].split("+")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and r["label"] == str(int(a) + int(b))
    assert gr.addition_questions(300, 50, seed=3) == (train, held)
    with pytest.raises(SystemExit, match="at most 8100"):
        gr.addition_questions(8100, 1, seed=0)


def test_reward_is_the_last_integer(gr, tmp_path):
    path = tmp_path / "r.py"
    path.write_text(gr.REWARD_SRC)
    mod = gr.load_reward_module(str(path))
    assert mod.answer_correct("12 + 35 = 47.", "47") == 1.0
    assert mod.answer_correct("47 is 12+35", "47") == 0.0  # the last number is 35
    assert mod.answer_correct("forty-seven", "47") == 0.0
    assert mod.answer_correct("The answer is 147", "47") == 0.0
    prompt = "<|im_start|>user\nWhat is 12+35?<|im_end|>\n<|im_start|>assistant\n"
    out = mod.reward_func([prompt + "47<|im_end|>", prompt + "I think 46", prompt], [prompt] * 3, ["47"] * 3)
    assert out == {"rewards": [1.0, 0.0, 0.0], "scores": [1.0, 0.0, 0.0]}  # the prompt's 35 is not the answer


def test_headline_by_hand(gr):
    runs = {"rlhfkit": {"accuracy_after": 0.8, "wall_s": 40.0, "first_step_s": 9.0, "step_s_median": 0.3},
            "trl": {"accuracy_after": 0.75, "wall_s": 100.0, "first_step_s": 3.0, "step_s_median": 1.2}}
    h = gr.headline(runs, 0.16)
    assert h["accuracy_before"] == 0.16 and h["wall_ratio"] == pytest.approx(0.4)
    assert h["rlhfkit_wall_at_most_half_of_trl"] and h["rlhfkit_accuracy_at_least_trl"]
    runs["rlhfkit"].update(accuracy_after=0.7, wall_s=60.0)
    h = gr.headline(runs, 0.16)
    assert not h["rlhfkit_wall_at_most_half_of_trl"] and not h["rlhfkit_accuracy_at_least_trl"]
    assert "wall_ratio" not in gr.headline({"rlhfkit": runs["rlhfkit"]}, 0.16)


def test_smoke_sizes_are_defaults_and_flags_win(gr, model_dir):
    a = gr.parse_args(["--smoke", "--model_dir", model_dir])
    assert {k: getattr(a, k) for k in gr.SMOKE} == gr.SMOKE
    a = gr.parse_args(["--smoke", "--model_dir", model_dir, "--new_tokens", "48"])
    assert a.new_tokens == 48 and a.prompts == gr.SMOKE["prompts"]
    assert gr.parse_args(["--model_dir", model_dir]).steps == 80
    with pytest.raises(SystemExit, match="no model there"):
        gr.parse_args(["--model_dir", os.path.join(model_dir, "none")])
    with pytest.raises(SystemExit, match="--n must be >= 2"):
        gr.parse_args(["--model_dir", model_dir, "--n", "1"])


def test_two_processes_end_in_one_json(gr, model_dir, tmp_path):
    out = str(tmp_path / "g.json")
    before = {"accuracy": 0.16}
    a = gr.parse_args(["--model_dir", model_dir, "--device", "cpu", "--out", out])
    gr.report(a, {"rlhfkit": {"accuracy_after": 0.8, "wall_s": 40.0}}, before, complete=True)
    res = gr.report(a, {"trl": {"accuracy_after": 0.7, "wall_s": 100.0}}, before, complete=True)
    assert set(res["runs"]) == {"rlhfkit", "trl"} and res["wall_ratio"] == pytest.approx(0.4)
    assert json.load(open(out))["runs"] == res["runs"]
    other = gr.parse_args(["--model_dir", model_dir, "--device", "cpu", "--out", out, "--lr", "3e-6"])
    res = gr.report(other, {"trl": {"accuracy_after": 0.7, "wall_s": 100.0}}, before, complete=True)
    assert set(res["runs"]) == {"trl"}  # another setting: the earlier rlhfkit record is not mixed in
