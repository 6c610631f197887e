"""What bench/rl_step.py and the benches built on it (harness/ray_step.py, harness/trl_step.py, rl_step_vlm.py,
first_step.py, grpo_real.py, scale_ckpt.py) share: the phase names, the bench reward file, the flags of rlhfkit's
run, the engine batch size for a step, and the summary of rlhfkit's steps."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from typing import Any

from bench.harness.timing import mean, median

PHASES = ("generate", "reward", "logprobs", "train", "weight_sync")


REWARD_SRC = '''"""Bench reward: the fraction of digit characters in the completion (rlhfkit reward_func API)."""


def digit_fraction(text):
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def reward_func(queries, prompts, labels):
    out = [digit_fraction(q[len(p):] if q.startswith(p) else q) for q, p in zip(queries, prompts)]
    return {"rewards": out, "scores": out}
'''


def micro(total: int, want: int) -> int:
    """The largest divisor of `total` that is at most `want` (micro batches must divide the batch)."""
    for m in range(min(total, want), 0, -1):
        if total % m == 0:
            return m
    return 1


def write_inputs(work: str, prompts: list[str]) -> tuple[str, str]:
    """The reward_func file and the prompt jsonl -> their paths."""
    reward = os.path.join(work, "bench_reward.py")
    with open(reward, "w") as f:
        f.write(REWARD_SRC)
    data = os.path.join(work, f"prompts_{len(prompts)}.jsonl")
    with open(data, "w") as f:
        for p in prompts:
            f.write(json.dumps({"input": p}) + "\n")
    return reward, data


def load_reward_module(path: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_reward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rlhfkit_argv(a: argparse.Namespace, model_dir: str, data: str, reward: str, work: str, prompts: int) -> list[str]:
    total = prompts * a.n
    gpu = a.device.startswith("cuda")
    argv = ["--pretrain", model_dir, "--remote_rm_url", reward, "--prompt_data", data, "--input_key", "input",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(a.n),
            "--rollout_batch_size", str(prompts), "--train_batch_size", str(total),
            "--micro_train_batch_size", str(micro(total, a.micro_train_batch_size)),
            "--micro_rollout_batch_size", str(micro(total, a.micro_rollout_batch_size)),
            "--init_kl_coef", "0", "--generate_max_len", str(a.new_tokens),
            "--prompt_max_len", str(a.prompt_len + 8), "--max_steps", str(a.total_steps),
            "--actor_learning_rate", str(a.lr), "--temperature", "1.0", "--seed", str(a.seed),
            "--param_dtype", "bf16" if gpu else "fp32", "--device", a.device,
            "--rollout_engine", a.rollout_engine, "--disable_progress",
            "--save_path", os.path.join(work, "ckpt"), "--run_dir", os.path.join(work, f"run_{prompts}")]
    if a.gradient_checkpointing:
        argv.append("--gradient_checkpointing")
    if a.adam_offload:
        argv.append("--adam_offload")
    return argv + shlex.split(a.rlhfkit_flags)


def engine_batch_size(engine: Any) -> int | None:
    """The batch the engine was built with (builtin: max_num_seqs; hf: max_batch_size)."""
    cfg = getattr(engine, "config", None)
    return getattr(cfg, "max_num_seqs", None) or getattr(engine, "max_batch_size", None)


def force_full_length(trainer: Any) -> int:
    """Bench-only: ban eos until max_new_tokens, so every completion has exactly that many tokens."""
    cfg = trainer.executor.config
    cfg.sampling_params = cfg.sampling_params.replace(min_new_tokens=cfg.sampling_params.max_new_tokens)
    return cfg.sampling_params.min_new_tokens


def summarize_rlhfkit(walls: list[float], metrics: list[dict], completions: int) -> dict:
    phases = {p: mean([m[f"time/{p}"] for m in metrics]) for p in PHASES}
    resp = mean([m["response_length"] for m in metrics])
    gen = phases["generate"]
    return {
        "framework": "rlhfkit", "step_s": mean(walls), "step_s_median": median(walls), "step_s_each": walls,
        "loop_step_s": mean([m["time/step"] for m in metrics]), "phases_s": phases,
        "phases_each": [{p: round(m[f"time/{p}"], 4) for p in PHASES} for m in metrics],
        "gc_s_each": [round(m["gc_s"], 4) if "gc_s" in m else None for m in metrics],
        "compiles_each": [m.get("compiles") for m in metrics],
        "alloc_retries_each": [m.get("alloc_retries") for m in metrics],
        "device_allocs_each": [m.get("device_allocs") for m in metrics],
        "device_frees_each": [m.get("device_frees") for m in metrics],
        "generate_share": mean([m["generate_share"] for m in metrics]),
        "gen_tokens_per_s": completions * resp / gen if gen else None,
        "response_length": resp, "truncated_rate": mean([m["truncated_rate"] for m in metrics]),
        "reward": mean([m["reward"] for m in metrics]),
        "skipped_zero_advantage_steps": sum(int(m.get("skipped_zero_advantage", 0)) for m in metrics),
        # KL of the engine's sampling log-probs from the trainer's: near 0 when both run the same weights
        "engine_trainer_kl_each": [m.get("vllm_kl") for m in metrics],
    }


class engine_batch:
    """Bench-only: build the rollout engine with a batch of `max_num_seqs` sequences.

    train_ppo's `build_engine_for` passes no batch size (builtin: 64 sequences, hf: 64 rows);
    this wraps `rlhfkit.rollout.build_engine` while `build_trainer` runs."""

    def __init__(self, max_num_seqs: int) -> None:
        self.n = max_num_seqs

    def __enter__(self) -> "engine_batch":
        import rlhfkit.rollout as R

        self.R, self.orig = R, R.build_engine
        if self.n > 0:
            key = {"builtin": "max_num_seqs", "hf": "max_batch_size"}

            def build(name: str, *args: Any, **opts: Any) -> Any:
                if name in key:
                    opts.setdefault(key[name], self.n)
                return self.orig(name, *args, **opts)

            R.build_engine = build
        return self

    def __exit__(self, *exc: Any) -> None:
        self.R.build_engine = self.orig
