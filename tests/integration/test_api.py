"""The Python API (rlhfkit.api): the example flow, one code path with the CLIs, rewards as callables.

- examples/api_sft_then_grpo.py runs (SFT then GRPO on 1-digit addition, tiny model, seed 0) and
  GRPO's reward rises: measured 0.655 (mean of the first 5 steps) -> 0.775 (last 5), also +0.12
  with seed 1; the test asks for +0.05. Both trainers' histories are the records of metrics.jsonl.
- rows in memory (a list, a datasets.Dataset) give the same first-step loss as the same rows in a
  file run by the CLI's main() (SFT, DPO), and the same run_config.json but for the input paths.
- a callable reward with in-memory prompts gives the same first step as the reward_func file and
  prompt file run by train_ppo.main(); a callable raising for one sample follows --reward_failure
  (drop: that prompt's samples are dropped and counted, the run goes on; stop: RewardFailure naming
  the function and the prompt).
- config fields are the command's flags (defaults, bad values, unknown names); the other trainers
  (reward model, KTO, RLOO with two weighted rewards, PPO with a critic) run a step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import runpy
import sys

import pytest
from helpers import even_reward_src

from rlhfkit import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    PPOConfig,
    PPOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
    mean_metric,
    metric_values,
    per_sample,
)
from rlhfkit.agents.base import RewardFailure
from rlhfkit.api.config import command_parser
from rlhfkit.api.history import metric_key
from rlhfkit.cli import train_dpo, train_ppo, train_sft
from rlhfkit.tasks.addition import addition_splits

# --dist loadgroup: one worker builds its example run, not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("api")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "api_sft_then_grpo.py")
MIN_GAIN = 0.05  # measured +0.12 (seed 0 and 1)
CPU = dict(device="cpu", param_dtype="fp32", disable_progress=True, lr_warmup_ratio=0.0)


def val(record: dict, name: str) -> float:
    """Metric `name` of a history record, whatever namespace its key has (rlhfkit.api.history)."""
    key = metric_key(record, name)
    assert key is not None, (name, sorted(record))
    return record[key]


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def same_records(history: list[dict], path: str) -> None:
    """history == the run's metrics.jsonl: same records, keys and (finite) values."""
    logged = read_jsonl(path)
    assert [sorted(r) for r in history] == [sorted(r) for r in logged]
    for h, r in zip(history, logged):
        for k, v in h.items():
            if isinstance(v, float) and isinstance(r[k], float):
                assert v == pytest.approx(r[k], rel=1e-12, abs=0.0), k


# ----------------------------------------------------------------------------- the example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("api_example"))
    argv = sys.argv
    sys.argv = [EXAMPLE, run]
    try:
        ns = runpy.run_path(EXAMPLE, run_name="__main__")
    finally:
        sys.argv = argv
    return run, ns


def test_example_grpo_reward_rises(example):
    _, ns = example
    rewards = metric_values(ns["history"], "reward")
    assert len(rewards) == 40
    first, last = mean_metric(ns["history"][:5], "reward"), mean_metric(ns["history"][-5:], "reward")
    assert last - first >= MIN_GAIN, (first, last, rewards)


def test_train_returns_the_metrics_jsonl_records(example):
    run, ns = example
    same_records(ns["history"], os.path.join(run, "grpo", "metrics.jsonl"))
    same_records(ns["sft"].history, os.path.join(run, "sft", "metrics.jsonl"))
    assert [r["step"] for r in ns["sft"].history] == [50, 100, 150, 200]
    assert os.path.isfile(os.path.join(run, "grpo", "model.safetensors"))
    # GRPO got the SFT model as an object: its card names where that model lives (its name_or_path)
    card = open(os.path.join(run, "grpo", "README.md")).read()
    assert f"| base model | `{run}/sft` |" in card


# ----------------------------------------------------------------------------- one path with the CLIs


def run_config(d: str) -> dict:
    with open(os.path.join(d, "run_config.json")) as f:
        cfg = json.load(f)
    return {k: v for k, v in cfg.items() if k not in ("pretrain", "dataset", "save_path", "ckpt_path")}


def test_sft_rows_in_memory_equal_the_file(tiny_model_dir, tmp_path):
    rows, _ = addition_splits(32, 0, digits=2, seed=3)
    cfg = SFTConfig(output_key="output", input_template="{}", max_len=32, train_batch_size=8, micro_train_batch_size=4,
                    max_steps=2, learning_rate=1e-3, **CPU)
    cli = dataclasses.replace(cfg, save_path=str(tmp_path / "cli"))
    h_cli = train_sft.main(["--pretrain", tiny_model_dir, "--dataset", write_jsonl(tmp_path / "d.jsonl", rows),
                            *cli.to_argv()])
    h_api = SFTTrainer(tiny_model_dir, args=dataclasses.replace(cfg, save_path=str(tmp_path / "api")),
                       train_dataset=rows).train()
    assert len(h_cli) == len(h_api) == 2
    assert val(h_api[0], "loss") == val(h_cli[0], "loss") and val(h_api[1], "loss") == val(h_cli[1], "loss")
    assert run_config(str(tmp_path / "api")) == run_config(str(tmp_path / "cli"))
    datasets = pytest.importorskip("datasets")
    h_hf = SFTTrainer(tiny_model_dir, args=dataclasses.replace(cfg, save_path=str(tmp_path / "hf")),
                      train_dataset=datasets.Dataset.from_list(rows)).train()
    assert val(h_hf[0], "loss") == val(h_cli[0], "loss")


def test_dpo_rows_in_memory_equal_the_file(tiny_model_dir, tmp_path):
    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + (a * b) % 3)}
             for a in range(4) for b in range(4)]
    cfg = DPOConfig(prompt_key="prompt", input_template="{}", max_len=32, train_batch_size=8, micro_train_batch_size=4,
                    max_steps=1, learning_rate=1e-3, beta=0.1, label_smoothing=0.1, **CPU)  # cDPO
    h_cli = train_dpo.main(["--pretrain", tiny_model_dir, "--dataset", write_jsonl(tmp_path / "p.jsonl", pairs),
                            *dataclasses.replace(cfg, save_path=str(tmp_path / "cli")).to_argv()])
    h_api = DPOTrainer(tiny_model_dir, args=dataclasses.replace(cfg, save_path=str(tmp_path / "api")),
                       train_dataset=pairs).train()
    assert val(h_api[0], "loss") == val(h_cli[0], "loss")
    assert val(h_api[0], "loss") == pytest.approx(math.log(2), abs=1e-5)  # policy = reference at step 1: log 2
    assert run_config(str(tmp_path / "api")) == run_config(str(tmp_path / "cli"))


# ----------------------------------------------------------------------------- rewards


def prompts(bad: int | None = None) -> list[dict]:
    rows, _ = addition_splits(4, 0, digits=2, seed=5)
    return [{"input": ("x" if i == bad else "") + r["input"], "label": r["label"]} for i, r in enumerate(rows)]


def even_fraction(completion: str, prompt: str, label) -> float:
    if "x" in prompt:
        raise ValueError("no verifier for this question")
    return sum(ord(c) % 2 == 0 for c in completion) / max(len(completion), 1)


EVEN_SRC = even_reward_src(scores=False)  # {"rewards": the fraction of even characters of each completion}


def rl_config(save: str, **kw) -> GRPOConfig:
    fields = dict(label_key="label", n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=8,
                  micro_train_batch_size=4, generate_max_len=6, prompt_max_len=16, max_steps=1,
                  actor_learning_rate=1e-3, save_path=save, seed=7, **CPU)
    fields.update(kw)
    return GRPOConfig(**fields)


def test_callable_reward_equals_the_reward_file(tiny_model_dir, tmp_path):
    (tmp_path / "reward.py").write_text(EVEN_SRC)
    space: dict = {}
    exec(EVEN_SRC, space)
    cfg = rl_config(str(tmp_path / "cli"))
    h_cli = train_ppo.main(["--pretrain", tiny_model_dir, "--prompt_data", write_jsonl(tmp_path / "p.jsonl", prompts()),
                            "--remote_rm_url", str(tmp_path / "reward.py"), *cfg.to_argv()])
    h_api = PPOTrainer(tiny_model_dir, reward_funcs=space["reward_func"], train_dataset=prompts(),
                       args=dataclasses.replace(cfg, save_path=str(tmp_path / "api"))).train()
    for key in ("reward", "policy_loss", "response_length"):
        assert val(h_api[0], key) == val(h_cli[0], key), key
    assert 0.0 < val(h_api[0], "reward") < 1.0


def test_callable_reward_failure_drop_and_stop(tiny_model_dir, tmp_path):
    reward = per_sample(even_fraction)
    drop = rl_config(str(tmp_path / "drop"), reward_failure="drop", num_episodes=2, max_steps=2)
    h = GRPOTrainer(tiny_model_dir, reward_funcs=reward, train_dataset=prompts(bad=1), args=drop).train()
    assert metric_values(h, "dropped_samples") == [2.0, 2.0]  # the bad prompt's 2 samples, each step
    assert all(0.0 <= r <= 1.0 for r in metric_values(h, "reward")) and len(h) == 2
    stop = rl_config(str(tmp_path / "stop"), reward_failure="stop")
    with pytest.raises(RewardFailure, match=r"even_fraction.*no verifier.*'x"):
        GRPOTrainer(tiny_model_dir, reward_funcs=reward, train_dataset=prompts(bad=1), args=stop).train()


def test_combined_rewards_are_weighted_sums():
    import asyncio

    from rlhfkit.api.inputs import combine_rewards

    def a(queries, prompts, labels):
        return [1.0, 0.0]

    def b(queries, prompts, labels):
        return {"rewards": [0.5, 0.25], "scores": [1.0, 1.0], "extra_logs": {"n": [1.0, 2.0]}}

    out = asyncio.run(combine_rewards([a, b], [2.0, 4.0])(["pq1", "pq2"], ["p", "p"], [None, None]))
    assert out["rewards"] == [4.0, 1.0] and out["scores"] == [2.0 + 4.0, 4.0]
    assert out["extra_logs"] == {"reward_a": [1.0, 0.0], "reward_b": [0.5, 0.25], "n": [1.0, 2.0]}
    assert per_sample(lambda c, p, lab: len(c) + (lab == "y"))(["ab!", "cd??"], ["ab", "cd"], ["y", "n"]) == [2.0, 2.0]
    with pytest.raises(ValueError, match="2 reward functions"):
        combine_rewards([a, b], [1.0])


def test_metric_lookup_takes_either_spelling():
    hist = [{"step": 0, "eval/pass1": 0.25}, {"step": 1, "train/reward": 0.5}, {"step": 2, "reward": 1.0}]
    assert metric_values(hist, "reward") == [0.5, 1.0] and metric_values(hist, "eval_pass1") == [0.25]
    assert mean_metric(hist, "reward") == 0.75
    with pytest.raises(ValueError, match="'kl'"):
        mean_metric(hist, "kl")


# ----------------------------------------------------------------------------- configs


def test_config_fields_are_the_flags():
    parser = command_parser("train_ppo")
    cfg = PPOConfig()
    assert cfg.to_argv() == [] and vars(cfg.to_args()) == vars(parser.parse([]))
    fields = {f.name for f in dataclasses.fields(cfg)}
    assert "actor_learning_rate" in fields and "pretrain" not in fields and "prompt_data" not in fields
    g = GRPOConfig(n_samples_per_prompt=4, muon_nesterov=False, reward_clip_range=[-1.0, 2.0])
    ns = g.to_args()
    assert (ns.advantage_estimator, ns.n_samples_per_prompt, ns.use_kl_loss, ns.kl_estimator) == ("group_norm", 4,
                                                                                                     True, "k3")
    assert ns.muon_nesterov is False and ns.reward_clip_range == [-1.0, 2.0]
    assert vars(ns) == vars(parser.parse(g.to_argv()))
    assert RLOOConfig().to_args().advantage_estimator == "rloo"
    assert SFTConfig().learning_rate == command_parser("train_sft").get_default("learning_rate")
    with pytest.raises(ValueError, match="--advantage_estimator.*invalid choice"):
        GRPOConfig(advantage_estimator="gpro").to_args()
    with pytest.raises(TypeError, match="lerning_rate"):
        SFTConfig(lerning_rate=1e-3)
    with pytest.raises(ValueError, match="train_dataset is required"):
        SFTTrainer("some/dir")
    with pytest.raises(TypeError, match="reward_funcs"):
        GRPOTrainer("some/dir", reward_funcs=[3], train_dataset=[{"input": "1"}])
    assert "--max_len=16" in SFTConfig(max_len=16).to_command(pretrain="m", dataset="d.jsonl")


# ----------------------------------------------------------------------------- the other trainers


def test_reward_kto_rloo_ppo_trainers_run_a_step(tiny_model_dir, tmp_path):
    pairs = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(8)]
    rm = RewardTrainer(tiny_model_dir, train_dataset=pairs, args=RewardConfig(
        prompt_key="prompt", input_template="{}", max_len=32, train_batch_size=8, micro_train_batch_size=4, max_steps=1,
        save_path=str(tmp_path / "rm"), **CPU))
    h = rm.train()
    assert val(h[0], "loss") > 0 and val(h[-1], "reward_std") > 0
    same_records(h, str(tmp_path / "rm" / "metrics.jsonl"))
    assert rm.save_model(str(tmp_path / "rm2")) == str(tmp_path / "rm2")
    assert os.path.isfile(str(tmp_path / "rm2" / "config.json"))

    rows = [{"input": f"{a}+1=", "output": str(a + 1 - (a % 2)), "label": a % 2 == 0} for a in range(8)]
    h = KTOTrainer(tiny_model_dir, train_dataset=rows, args=KTOConfig(
        input_template="{}", max_len=32, train_batch_size=8, micro_train_batch_size=4, max_steps=1,
        save_path=str(tmp_path / "kto"), **CPU)).train()
    assert val(h[0], "loss") > 0

    def even(queries, prompts, labels):
        return [sum(ord(ch) % 2 == 0 for ch in q[len(p):]) / 6 for q, p in zip(queries, prompts)]

    def half(queries, prompts, labels):
        return [0.5] * len(queries)

    base = dataclasses.asdict(rl_config(str(tmp_path / "rloo")))
    base.pop("advantage_estimator"), base.pop("use_kl_loss"), base.pop("kl_estimator"), base.pop("init_kl_coef")
    h = RLOOTrainer(tiny_model_dir, reward_funcs=[even, half], reward_weights=[1.0, 2.0], train_dataset=prompts(),
                    args=RLOOConfig(**{**base, "n_samples_per_prompt": 2})).train()
    assert val(h[0], "reward") == pytest.approx(val(h[0], "reward_even") + 1.0, abs=1e-6)
    assert val(h[0], "reward_half") == pytest.approx(0.5)
    h = PPOTrainer(tiny_model_dir, reward_funcs=even, train_dataset=prompts(),
                   args=PPOConfig(**{**base, "save_path": str(tmp_path / "ppo"), "n_samples_per_prompt": 1,
                                     "train_batch_size": 4})).train()
    assert val(h[0], "value_loss") >= 0 and val(h[0], "reward") >= 0  # gae: a critic was trained
    same_records(h, str(tmp_path / "ppo" / "metrics.jsonl"))


def test_import_rlhfkit_is_cheap_and_lazy():
    import subprocess

    from helpers import subprocess_env

    code = ("import sys, rlhfkit; assert 'torch' not in sys.modules, 'torch'; "
            "assert 'GRPOTrainer' in dir(rlhfkit); from rlhfkit import GRPOTrainer; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env(), timeout=120)


def test_rows_in_memory_forms_and_errors(tiny_model_dir, tmp_path):
    from rlhfkit.data.io import DataError, RowSource, load_mixture

    rows = [{"input": f"{i}+1=", "output": str(i + 1)} for i in range(5)]
    columns = {"input": [r["input"] for r in rows], "output": [r["output"] for r in rows]}
    assert [r.data for r in load_mixture(RowSource(columns, "cols"))] == rows
    assert [r.data for r in load_mixture(RowSource(rows, "rows"), max_samples=3)] == rows[:3]
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[3:])})
    assert [r.data for r in load_mixture(RowSource(dd, "dd"), split="test")] == rows[3:]
    with pytest.raises(DataError, match="train_dataset row 3: missing key 'output'"):
        SFTTrainer(tiny_model_dir, train_dataset=rows[:2] + [{"input": "x"}], args=SFTConfig(
            output_key="output", max_len=32, save_path=str(tmp_path / "x"), **CPU)).train()
    with pytest.raises(DataError, match="train_dataset: expected a list of dicts"):
        SFTTrainer(tiny_model_dir, train_dataset=42,
                   args=SFTConfig(max_len=32, save_path=str(tmp_path / "x"), **CPU)).train()


def test_model_cards_name_where_a_loaded_model_came_from(tiny_model_dir, tmp_path):
    """A model passed as an object reaches the run as that object; the card names its origin (the directory
    it was loaded from, which exists), or says it was a Python object.
    After train() the trained model's name_or_path is its save_path, so a next trainer's card names that."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    rows, _ = addition_splits(16, 0, digits=1, seed=0)
    cfg = dict(output_key="output", input_template="{}", max_len=32, train_batch_size=8, micro_train_batch_size=8,
               max_steps=1, **CPU)

    def card_base(save: str) -> str:
        card = open(os.path.join(save, "README.md")).read()
        return next(line for line in card.splitlines() if line.startswith("| base model |"))

    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    first = SFTTrainer(loaded, train_dataset=rows, args=SFTConfig(save_path=str(tmp_path / "a"), **cfg))
    first.train()
    assert card_base(str(tmp_path / "a")) == f"| base model | `{tiny_model_dir}` |"
    assert first.model.name_or_path == str(tmp_path / "a")
    SFTTrainer(first.model, processing_class=first.tokenizer, train_dataset=rows,
               args=SFTConfig(save_path=str(tmp_path / "b"), **cfg)).train()
    assert card_base(str(tmp_path / "b")) == f"| base model | `{tmp_path / 'a'}` |"
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    fresh.name_or_path = ""  # built in Python, loaded from nowhere
    SFTTrainer(fresh, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir), train_dataset=rows,
               args=SFTConfig(save_path=str(tmp_path / "c"), **cfg)).train()
    assert card_base(str(tmp_path / "c")) == "| base model | `a LlamaForCausalLM passed to the Python API` |"
