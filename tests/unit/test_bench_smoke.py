"""bench/rl_step.py and bench/harness/models.py: a CPU smoke run of the RL-step benchmark (tiny model,
rlhfkit only) whose figures are checked against each other, plus the helpers' hand-worked values."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.* imports from here


@pytest.fixture(scope="module")
def rl_step():
    sys.path.insert(0, ROOT)
    env = dict(os.environ)
    try:
        module = importlib.import_module("bench.rl_step")
        # what the bench sets for its own runs on import (HF_DATASETS_OFFLINE ...: the tests are offline already) would
        # give the processes this worker starts another import environment (tests/conftest.py: _import_env_kept)
        os.environ.clear()
        os.environ.update(env)
        yield module
    finally:
        sys.path.remove(ROOT)


def test_micro_is_largest_divisor(rl_step):
    from bench.harness.rl_run import micro  # the repository is on the path while the fixture runs

    assert micro(512, 16) == 16
    assert micro(24, 16) == 12  # 16 does not divide 24
    assert micro(8, 32) == 8  # capped at the batch
    assert micro(7, 4) == 1  # prime batch


def test_force_full_length_bans_eos_until_the_limit(rl_step):
    from types import SimpleNamespace

    from rlhfkit.types import SamplingParams

    sp = SamplingParams(temperature=0.7, max_new_tokens=7, seed=3)
    trainer = SimpleNamespace(executor=SimpleNamespace(config=SimpleNamespace(sampling_params=sp)))
    assert rl_step.force_full_length(trainer) == 7
    new = trainer.executor.config.sampling_params
    assert (new.min_new_tokens, new.max_new_tokens, new.temperature, new.seed) == (7, 7, 0.7, 3)


def test_filler_tokenizer_covers_every_id():
    sys.path.insert(0, ROOT)
    try:
        from bench.harness.models import build_filler_tokenizer, filler_vocab
    finally:
        sys.path.remove(ROOT)
    vocab = filler_vocab(300)
    assert len(vocab) == 300 and sorted(vocab.values()) == list(range(300))
    tok = build_filler_tokenizer(300)
    assert len(tok) == 300 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.decode([299]) == "<t299>"
    ids = tok("ab 7")["input_ids"]
    assert len(ids) == 4 and tok.decode(ids) == "ab 7"  # one token per character
    with pytest.raises(ValueError, match="vocab_size"):
        filler_vocab(10)


def test_trl_timer_and_headline_by_hand(rl_step):
    from bench.harness import trl_step

    t = trl_step._TRLTimer("cpu")
    t.ends = [10.0, 14.0, 20.0]  # step ends: the warm-up step is not timed -> steps of 4 s and 6 s
    t.gen = [9.0, 2.0, 3.0]
    t.logs = [{"completions/mean_length": 1.0, "reward": 9.0}, {"completions/mean_length": 8.0, "reward": 0.5},
              {"completions/mean_length": 8.0, "reward": 0.25}]
    s = t.summary(completions=10)
    assert s["step_s"] == pytest.approx(5.0) and s["generate_s"] == pytest.approx(2.5)
    assert s["step_s_median"] == pytest.approx(5.0) and rl_step.median([3.0, 1.0, 10.0]) == 3.0
    assert s["generate_share"] == pytest.approx(0.5)
    assert s["gen_tokens_per_s"] == pytest.approx(10 * 8 / 2.5)
    assert s["reward"] == pytest.approx(0.375)
    a = rl_step.parse_args(["--device", "cpu", "--prompts", "4", "--n", "2", "--trl_prompts", "2", "4"])
    rk = {"framework": "rlhfkit", "prompts": 4, "step_s": 2.0, "step_s_median": 1.0, "phases_s": {},
          "generate_share": 0.5,
          "gen_tokens_per_s": 1.0, "response_length": 8.0}
    runs = [rk, {**s, "prompts": 2}, {**s, "prompts": 4, "step_s": 7.0, "step_s_median": 6.0},
            {"framework": "trl", "prompts": 8, "error": "OOM"}]
    h = rl_step.headline(a, runs)
    assert h["trl_prompts"] == 4 and h["trl_step_s"] == 7.0 and h["speedup_vs_trl"] == pytest.approx(3.5)
    assert h["speedup_vs_trl_median"] == pytest.approx(6.0) and h["step_s"] == 2.0


def test_cpu_smoke_run(rl_step, tmp_path):
    out = tmp_path / "r.json"
    new = 6
    res = rl_step.main(["--model", "tiny", "--device", "cpu", "--prompts", "4", "--n", "2", "--prompt_len", "12",
                        "--new_tokens", str(new), "--steps", "1", "--skip_trl", "--model_dir",
                        str(tmp_path / "m"), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["complete"] and res["completions"] == 8 and res["model"] == "tiny"
    [run] = res["runs"]
    assert "error" not in run, run.get("error")
    # the engine was built with all 8 completions in one batch (train_ppo's default would be 64)
    assert run["framework"] == "rlhfkit" and run["engine_max_num_seqs"] == 8 and run["min_new_tokens"] == new
    # eos is banned until the limit: every completion is exactly --new_tokens long
    assert run["response_length"] == new and run["truncated_rate"] == 1.0
    assert len(run["step_s_each"]) == 1  # the warm-up step is not timed
    phases = run["phases_s"]
    assert sum(phases.values()) == pytest.approx(run["loop_step_s"], rel=1e-6)
    assert run["loop_step_s"] <= run["step_s"]
    assert run["generate_share"] == pytest.approx(phases["generate"] / run["loop_step_s"], rel=1e-6)
    assert run["gen_tokens_per_s"] == pytest.approx(8 * new / phases["generate"], rel=1e-6)
    assert 0.0 <= run["reward"] <= 1.0
    assert res["step_s"] == run["step_s"] and "trl_step_s" not in res
    import rlhfkit.rollout as R

    assert R.build_engine.__name__ == "build_engine"  # the bench's engine-size hook was removed


def test_rollout_vlm_smoke_counts_one_tower_call_per_run():
    """bench/rollout_vlm.py on a tiny shape: every sequence runs its tokens in both engines; the n samples of
    a prompt share its picture (2 prompts of n = 2: one tower call of 2 pictures per run)."""
    sys.path.insert(0, ROOT)
    try:
        rollout_vlm = importlib.import_module("bench.rollout_vlm")
    finally:
        sys.path.remove(ROOT)
    rep = rollout_vlm.main(["--shape", "tiny", "--device", "cpu", "--batch", "4", "--shapes", "8x6", "--n", "2",
                            "--picture", "56", "--repeat", "1"])
    (row,) = rep["rows"]
    assert json.loads(json.dumps(rep)) == rep  # one JSON line
    assert row["picture_tokens"] == 4 and row["prompt_tokens"] == 14
    assert row["builtin_vision_calls_per_run"] == 1 and row["builtin_pictures_per_run"] == 2
    assert row["builtin_tok_s"] > 0 and row["speedup_vs_hf"] == pytest.approx(row["builtin_tok_s"] / row["hf_tok_s"])
