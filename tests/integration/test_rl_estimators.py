"""train_ppo end to end on the tiny model: every advantage estimator for 2 steps, and the flag checks.

Each estimator runs in-process (`train_ppo.main`) with a `reward_func` file whose reward varies
between samples (the share of even-coded characters in the completion). A spy on the policy's
`train_on` keeps the experience it trains on, and the test recomputes from those tokens, with a
short reference written here:
- the rewards (the reward_func applied to the decoded prompt + completion),
- the logged `reward` / `reward_std` (mean and population std of those rewards),
- the advantages: the estimator's scalar per row (GRPO (r - mean)/(std + 1e-9), Dr. GRPO r - mean,
  RLOO r - mean of the others, REINFORCE++(-baseline) whitened over all action tokens), which with
  the KL in the loss and gamma = 1 is the same on every action token and 0 elsewhere.
It also checks the metric keys the issue asks for, config.json in the run dir, and that the final
model at --save_path loads with AutoModelForCausalLM and differs from the start.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers import EVEN_REWARD as REWARD_FILE
from helpers import ppo_flags
import torch

from rlhfkit.cli import train_ppo

from rlhfkit.rl_run import builders
from rlhfkit.rl_run.resolve import resolve
from rlhfkit.cli.common import UsageError
from rlhfkit.roles.actor import ActorRole
from rlhfkit.tasks.addition import addition_splits

N, PROMPTS_PER_STEP, GEN = 2, 4, 6
ESTIMATORS = ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"]
REQUIRED = ["train/reward", "train/reward_std", "train/response_length", "train/kl", "train/policy_loss",
            "train/ppo_clip_ratio", "train/clip_ratio", "train/entropy", "train/grad_norm", "train/truncated_rate",
            "train/dropped_samples", "time/generate", "time/reward", "time/logprobs", "time/train",
            "time/weight_sync", "time/step", "train/generate_share", "train/even_frac"]


def even_reward(query: str, prompt: str) -> float:
    c = query[len(prompt):]
    return sum(ord(ch) % 2 == 0 for ch in c) / max(len(c), 1)


@pytest.fixture(scope="module")
def rl_files(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("rl_est_data")
    rows, _ = addition_splits(8, 4, seed=1)
    prompts = os.path.join(d, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"input": r["input"], "label": r["label"]}) + "\n" for r in rows)
    rf = os.path.join(d, "reward_even.py")
    with open(rf, "w") as f:
        f.write(REWARD_FILE)
    return prompts, rf


def base_argv(model: str, prompts: str, reward: str, out: str, est: str) -> list[str]:
    argv = ppo_flags(model, prompts, os.path.join(out, "model"), "--run_dir", os.path.join(out, "run"),
                     reward=reward, advantage_estimator=est, n_samples_per_prompt=N,
                     rollout_batch_size=PROMPTS_PER_STEP, train_batch_size=PROMPTS_PER_STEP * N,
                     micro_train_batch_size=4, generate_max_len=GEN, max_steps=2, init_kl_coef="0.01",
                     actor_learning_rate="1e-3", lr_warmup_ratio=0)
    return argv if est == "gae" else argv + ["--use_kl_loss"]  # gae: KL in the reward (PPO's default)


def spy_train_on(monkeypatch) -> list:
    seen = []
    real = ActorRole.train_on

    def train_on(self, batch, kl_coef=0.0):
        kept = batch.to("cpu")
        if kept.old_logprobs is None:  # one optimizer step: the training pass scores the samples itself;
            kept.old_logprobs = self.forward_logprobs(batch)  # the policy's log-probs now are what it uses
        seen.append(kept)
        return real(self, batch, kl_coef)

    monkeypatch.setattr(ActorRole, "train_on", train_on)
    return seen


def whiten(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std over the masked elements (biased variance, clamped at 1e-8, as OpenRLHF)."""
    mu = (x * m).sum() / m.sum()
    var = (((x - mu) * m) ** 2).sum() / m.sum()
    return (x - mu) * m / var.clamp(min=1e-8).sqrt()


def reference_scalar(est: str, r: torch.Tensor) -> torch.Tensor:
    """Per-row advantage before whitening, from the formulas (rows of a prompt contiguous)."""
    g = r.double().view(-1, N)
    mean = g.mean(1, keepdim=True)
    if est == "group_norm":
        out = (g - mean) / (g.std(1, keepdim=True) + 1e-9)
    elif est in ("dr_grpo", "reinforce_baseline"):
        out = g - mean
    elif est == "rloo":
        out = g - (g.sum(1, keepdim=True) - g) / (N - 1)
    else:  # reinforce: the reward itself
        out = g
    return out.flatten()


def reference_advantages(est: str, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.double()
    adv = reference_scalar(est, rewards)[:, None] * m
    # REINFORCE++(-baseline) whiten over every action token of the batch
    return whiten(adv, m) if est in ("reinforce", "reinforce_baseline") else adv


def check_gae(batch, kl_coef: float = 0.01) -> None:
    """PPO with gamma = lambda = 1: the return is the reward-to-go of the KL-shaped token rewards
    (r_t = -beta * (old - ref) log-probs, plus the reward on the last action token) and the GAE
    advantage telescopes to return - value, then is whitened."""
    m = batch.loss_mask.double()
    shaped = -kl_coef * (batch.old_logprobs.double() - batch.ref_logprobs.double()) * m
    last = (m * torch.arange(m.shape[1])).argmax(1)
    shaped[torch.arange(m.shape[0]), last] += batch.rewards.double()
    returns = shaped.flip(1).cumsum(1).flip(1) * m
    torch.testing.assert_close(batch.returns.double(), returns, atol=1e-5, rtol=1e-5)
    want = whiten((returns - batch.values.double()) * m, m)
    torch.testing.assert_close(batch.advantages.double(), want, atol=1e-4, rtol=1e-4)


def check_experience(batch, tokenizer, est: str) -> None:
    rows = []
    for i in range(batch.batch_size):
        n = int(batch.attention_mask[i].sum())
        ids = batch.input_ids[i, :n].tolist()
        first = int(batch.loss_mask[i].nonzero()[0])
        rows.append(even_reward(tokenizer.decode(ids, skip_special_tokens=False),
                                tokenizer.decode(ids[:first], skip_special_tokens=False)))
        assert batch.loss_mask[i, first:n].all() and not batch.loss_mask[i, n:].any()
    assert batch.rewards.tolist() == pytest.approx(rows, abs=1e-6)
    if est != "gae":
        want = reference_advantages(est, batch.rewards, batch.loss_mask)
        torch.testing.assert_close(batch.advantages.double(), want, atol=1e-4, rtol=1e-4)
    else:
        check_gae(batch)
    # what is trained on is what was sampled: rollout log-probs close to the policy's old log-probs
    m = batch.loss_mask.bool()
    assert (batch.rollout_logprobs[m] - batch.old_logprobs[m]).abs().max() < 1e-3


@pytest.mark.parametrize("est", ESTIMATORS)
def test_estimator_runs_two_steps(est, tiny_model_dir, rl_files, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts, rf = rl_files
    seen = spy_train_on(monkeypatch)
    train_ppo.main(base_argv(tiny_model_dir, prompts, rf, str(tmp_path), est))

    with open(tmp_path / "run" / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 2]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(seen) == 2 and all(b.batch_size == PROMPTS_PER_STEP * N for b in seen)
    for rec, batch in zip(recs, seen):
        missing = [k for k in REQUIRED + (["train/value_loss"] if est == "gae" else []) if k not in rec]
        assert not missing, f"{est}: metrics.jsonl lacks {missing}"
        assert all(isinstance(rec[k], (int, float)) and math.isfinite(rec[k]) for k in REQUIRED)
        check_experience(batch, tok, est)
        r = batch.rewards.double()
        assert rec["train/reward"] == pytest.approx(float(r.mean()), abs=1e-6)
        assert rec["train/reward_std"] == pytest.approx(float(r.std(unbiased=False)), abs=1e-6)
        assert rec["train/response_length"] == pytest.approx(float(batch.loss_mask.sum()) / batch.batch_size)
        assert 0 < rec["train/generate_share"] <= 1 and rec["train/clip_ratio"] == rec["train/ppo_clip_ratio"]
        assert rec["time/step"] >= rec["time/generate"] > 0
    with open(tmp_path / "run" / "run_config.json") as f:
        assert json.load(f)["advantage_estimator"] == est
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    before = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    after = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4, "the policy did not train"


# ----------------------------------------------------------------------------- flag checks


def parse(extra: list[str]):
    base = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "r.py", "--n_samples_per_prompt", "4",
            "--rollout_batch_size", "8", "--train_batch_size", "32", "--micro_train_batch_size", "8",
            "--generate_max_len", "8", "--prompt_max_len", "16", "--advantage_estimator", "group_norm"]
    return train_ppo.build_parser().parse(base + extra)


@pytest.mark.parametrize("extra, world, needle", [
    (["--n_samples_per_prompt", "1", "--train_batch_size", "8"], 1, "--n_samples_per_prompt"),
    (["--train_batch_size", "24"], 1, "--train_batch_size (24)"),
    (["--micro_train_batch_size", "16"], 4, "--micro_train_batch_size (16) x world size (4)"),
    (["--rollout_batch_size", "6", "--train_batch_size", "24", "--micro_train_batch_size", "2"], 4,
     "--rollout_batch_size (6) must be a multiple of the world size (4)"),
    (["--max_len", "8"], 1, "--generate_max_len (8) must be below --max_len (8)"),
    (["--agent_func_path", "a.py"], 1, "--agent_func_path and --remote_rm_url"),
    (["--remote_rm_url", ""], 1, "--reward_pretrain"),
    (["--advantage_estimator", "gae", "--n_samples_per_prompt", "1", "--train_batch_size", "8",
      "--dynamic_filtering"], 1, "--dynamic_filtering needs --n_samples_per_prompt > 1"),
    (["--load_in_4bit"], 1, "--load_in_4bit keeps the frozen base in 4 bits under LoRA adapters: it needs --lora_rank"),
    (["--lora_rank", "16", "--load_in_4bit"], 2, "--load_in_4bit: the rollout engine generates from a 4-bit base only "
                                                 "by serving the policy's own weights"),
])
def test_resolve_names_the_flag(extra, world, needle, model_dir_m):
    with pytest.raises(UsageError) as e:
        resolve(parse(extra), world)
    assert needle in str(e.value)
    if extra[:2] == ["--n_samples_per_prompt", "1"]:
        assert "group_norm" in str(e.value)


@pytest.fixture
def model_dir_m(tmp_path, monkeypatch):
    """A local directory named "m" (no config: positions unchecked), so --pretrain m resolves as a path, and
    the reward file r.py (read when the flags are resolved)."""
    monkeypatch.chdir(tmp_path)
    os.mkdir("m")
    with open("r.py", "w") as f:
        f.write("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")


def test_consistent_flags_pass(model_dir_m):
    args = resolve(parse([]), 2)
    assert args.max_len == 24


def test_cli_reports_bad_flags_in_one_line(tiny_model_dir, rl_files, tmp_path, capsys):
    prompts, rf = rl_files
    argv = base_argv(tiny_model_dir, prompts, rf, str(tmp_path), "group_norm")
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv + ["--n_samples_per_prompt", "1"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "train_ppo: error:" in err and "--n_samples_per_prompt" in err and "Traceback" not in err
    with pytest.raises(SystemExit):  # 8 prompts cannot fill one step of 16
        train_ppo.main(argv + ["--rollout_batch_size", "16", "--train_batch_size", "32"])
    assert "--rollout_batch_size (16)" in capsys.readouterr().err


def test_max_new_tokens_unset_with_max_len_is_what_the_prompt_leaves(model_dir_m):
    """OpenRLHF's dotted scripts give --data.max_len and no --rollout.max_new_tokens: each generation gets
    max_len - prompt tokens. Without --max_len the flat default 1024 holds; an explicit value must stay
    below --max_len."""
    base = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "r.py", "--rollout_batch_size", "8",
            "--train_batch_size", "8", "--micro_train_batch_size", "8"]
    args = resolve(train_ppo.build_parser().parse(base + ["--data.max_len", "72"]), 1)
    assert (args.max_len, args.generate_max_len) == (72, 72)
    cfg = builders.agent_config(args, 1.0)
    assert cfg.sampling_params.max_new_tokens == cfg.max_length == 72
    from rlhfkit.agents.executors import fit_prompt
    assert fit_prompt(list(range(30)), 72, 72, "x") == list(range(30))  # the prompt keeps its tokens
    assert fit_prompt(list(range(80)), 72, 72, "x") == list(range(9, 80))  # one token of room is left
    args = resolve(train_ppo.build_parser().parse(base + ["--prompt_max_len", "16"]), 1)
    assert (args.max_len, args.generate_max_len) == (16 + 1024, 1024)
    with pytest.raises(UsageError, match=r"--generate_max_len \(72\) must be below --max_len \(72\)"):
        resolve(train_ppo.build_parser().parse(base + ["--max_len", "72", "--max_new_tokens", "72"]), 1)
