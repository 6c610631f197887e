"""The RL composition root (rlhfkit.rl_run) plans a run once: one train_ppo process loads its tokenizer
exactly once, whatever the run uses it for (prompts, evaluation prompts, PPO-ptx text, a rollout engine
loading its own copy of the weights, a critic), counted where transformers reads a tokenizer from disk."""

from __future__ import annotations

import json

import pytest
from helpers import even_reward_src

from rlhfkit.cli import train_ppo
from rlhfkit.rl_run import root
from rlhfkit.rl_run.local import LocalLayout


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_one_train_ppo_process_loads_its_tokenizer_once(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    loads = []
    real = AutoTokenizer.from_pretrained.__func__

    def counted(cls, path, *a, **k):
        loads.append(str(path))
        return real(cls, path, *a, **k)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    plans = []
    real_plan = root.plan

    def spy(*a, **k):
        plans.append(real_plan(*a, **k))
        return plans[-1]

    monkeypatch.setattr(root, "plan", spy)
    prompts = [{"input": f"{i}+{i}=", "label": str(2 * i)} for i in range(8)]
    (tmp_path / "reward.py").write_text(even_reward_src(scores=False))
    train_ppo.main([
        "--pretrain", tiny_model_dir, "--remote_rm_url", str(tmp_path / "reward.py"),
        "--prompt_data", write_jsonl(tmp_path / "p.jsonl", prompts),
        "--eval_dataset", write_jsonl(tmp_path / "e.jsonl", prompts[:2]), "--eval_steps", "1",
        "--pretrain_data", write_jsonl(tmp_path / "t.jsonl", [{"input": f"{i} and {i}"} for i in range(8)]),
        "--ptx_coef", "0.1", "--input_key", "input", "--label_key", "label", "--advantage_estimator", "gae",
        "--engine_weights", "copy", "--rollout_batch_size", "4", "--train_batch_size", "4",
        "--micro_train_batch_size", "2", "--generate_max_len", "4", "--prompt_max_len", "16", "--max_steps", "1",
        "--init_kl_coef", "0.01", "--device", "cpu", "--disable_progress", "--save_path", str(tmp_path / "out"),
        "--run_dir", str(tmp_path / "run")])
    assert loads == [tiny_model_dir], loads
    (plan,) = plans  # computed once, for the local layout's roles
    assert plan.roles == {"policy": 1, "ref": 1, "critic": 1} and plan.num_steps == 1
    assert len(plan.data.prompts) == 8 and len(plan.data.eval_prompts) == 2


def test_the_plan_is_made_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """A bad setting found by the plan (here: the batch sizes) stops the run before the placement builds a role."""
    from rlhfkit.cli.common import UsageError
    from rlhfkit.rl_run import local

    monkeypatch.setattr(local, "local_placement", None)  # never reached
    (tmp_path / "reward.py").write_text(even_reward_src(scores=False))
    args = train_ppo.build_parser().parse([
        "--pretrain", tiny_model_dir, "--remote_rm_url", str(tmp_path / "reward.py"),
        "--prompt_data", write_jsonl(tmp_path / "p.jsonl", [{"input": "1+1="}] * 4), "--input_key", "input",
        "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
        "--train_batch_size", "3", "--micro_train_batch_size", "2", "--device", "cpu",
        "--save_path", str(tmp_path / "out")])
    with pytest.raises(UsageError, match=r"--train_batch_size \(3\) must be a multiple of --micro_train_batch_size"):
        root.plan(args, train_ppo.build_parser(), LocalLayout())


def test_ray_actor_builders_use_the_drivers_tokenizer(tiny_model_dir, tmp_path, monkeypatch):
    """What a Ray actor runs (rl_run.ray_layout.build_role / build_engine) gets the driver's tokenizer with the
    flags: building the policy with PPO-ptx text and an engine reads no tokenizer from disk."""
    from transformers import AutoTokenizer

    from rlhfkit.cli import train_ppo_ray
    from rlhfkit.models.hf_files import load_tokenizer
    from rlhfkit.parallel.dist import DistInfo
    from rlhfkit.rl_run import ray_layout
    from rlhfkit.rl_run.resolve import resolve

    (tmp_path / "reward.py").write_text(even_reward_src(scores=False))
    parsed = train_ppo_ray.build_parser().parse([
        "--pretrain", tiny_model_dir, "--remote_rm_url", str(tmp_path / "reward.py"),
        "--prompt_data", write_jsonl(tmp_path / "p.jsonl", [{"input": "1+1="}] * 4), "--input_key", "input",
        "--pretrain_data", write_jsonl(tmp_path / "t.jsonl", [{"input": f"{i} and {i}"} for i in range(8)]),
        "--ptx_coef", "0.1", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "2",
        "--generate_max_len", "4", "--prompt_max_len", "16", "--device", "cpu", "--save_path", str(tmp_path / "s")])
    args = resolve(parsed, 1)
    tokenizer = load_tokenizer(tiny_model_dir)  # the driver's

    def no_load(*a, **k):
        raise AssertionError("an actor builder loaded a tokenizer")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_load)
    role, _ = ray_layout.build_role(args, 2, tokenizer, "policy", DistInfo(device="cpu"))
    assert role.ptx is not None
    engine = ray_layout.build_engine(args, tokenizer, DistInfo(device="cpu"))
    assert engine.tokenizer is tokenizer
