"""The training CLIs with `--ring_attn_size 2` under torchrun (2 ranks: dp 1 x cp 2) == one process.

Same flags, same global batch: the ring only splits each sequence, so every step's loss and grad
norm must equal the one-process run's up to float32 summation order (observed ~1e-7; checked at
1e-5 relative), and so must the saved weights (checked at 1e-4 absolute: Adam's update m / sqrt(v)
is scale-free, so where v is tiny a 1e-7 gradient difference moves a weight by up to ~lr x 1e-3 per
step; observed 1.1e-5 after 8 SFT steps at lr 3e-3, while the weights move by > 1e-3).

Runs: train_sft with --packing_samples (4 steps); train_dpo and train_rm (2 steps each, padded; the
reward model's values go through the gathered value head); train_kto, train_prm (packed; its logits
are gathered whole) and train_kd (a frozen teacher on the ring too), from the OpenRLHF-script copies'
flags; train_ppo (GRPO, 2 RL steps: generation, reference and policy passes, KL loss).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import read_run, rl_flags, subprocess_env, torchrun_cmd

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOL = 1e-5
WEIGHT_TOL = 1e-4


def run_pair(module: str, flags: list[str], out: str) -> tuple[tuple, tuple]:
    """(metrics, weights) of one process and of torchrun 2 x --ring_attn_size 2."""
    one, two = os.path.join(out, "one"), os.path.join(out, "ring2")
    env = subprocess_env()
    ring = subprocess.Popen(torchrun_cmd(2, "-m", module, *flags, "--save_path", two, "--ring_attn_size", "2"),
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    single = subprocess.run([sys.executable, "-m", module, *flags, "--save_path", one], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    rout, rerr = ring.communicate(timeout=300)
    assert single.returncode == 0, single.stderr[-4000:]
    assert ring.returncode == 0, rout[-2000:] + rerr[-5000:]
    return read_run(one), read_run(two)


def assert_same(a: tuple, b: tuple, keys: list[str], steps: list[int] | None) -> None:
    """Records with keys[0] at `steps` (None: the same steps in both runs, at least 2) agree on `keys`;
    the saved weights agree."""
    (r1, w1), (r2, w2) = a, b
    assert len(r1) == len(r2)  # train_rm adds a record of reward statistics, compared like the steps
    r1, r2 = [r for r in r1 if keys[0] in r], [r for r in r2 if keys[0] in r]
    assert [r["step"] for r in r1] == [r["step"] for r in r2]
    assert [r["step"] for r in r1] == steps if steps is not None else len(r1) >= 2
    for x, y in zip(r1, r2):
        for k in keys:
            assert y[k] == pytest.approx(x[k], rel=TOL, abs=TOL), (x["step"], k, x[k], y[k])
    assert w1.keys() == w2.keys()
    for k in w1:
        assert float((w1[k] - w2[k]).abs().max()) < WEIGHT_TOL, k


def _gloo():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def _qa(path: str, n: int) -> str:
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = torch.randint(0, 50, (2,), generator=g).tolist()
            f.write(json.dumps({"question": f"{a}+{b}=", "response": str(a + b),
                                "chosen": str(a + b), "rejected": str(a + b + 1 + (a * b) % 3)}) + "\n")
    return path


COMMON = ["--max_len", "32", "--micro_train_batch_size", "4", "--lr_warmup_ratio", "0", "--disable_progress",
          "--param_dtype", "fp32", "--logging_steps", "1", "--save_steps", "-1", "--eval_steps", "-1"]


def test_train_sft_packed(tiny_model_dir, tmp_path):
    _gloo()
    data = _qa(str(tmp_path / "qa.jsonl"), 16)
    flags = ["--pretrain", tiny_model_dir, "--dataset", data, "--input_key", "question", "--output_key", "response",
             "--input_template", "{}", "--train_batch_size", "8", "--learning_rate", "3e-3", "--packing_samples",
             *COMMON]
    one, ring = run_pair("rlhfkit.cli.train_sft", flags, str(tmp_path))
    assert_same(one, ring, ["train/loss", "train/grad_norm"], [1, 2, 3, 4])
    assert one[0][0]["train/loss"] > 1.0


def test_train_dpo_and_rm(tiny_model_dir, tmp_path):
    _gloo()
    data = _qa(str(tmp_path / "pairs.jsonl"), 16)
    pref = ["--pretrain", tiny_model_dir, "--dataset", data, "--prompt_key", "question", "--chosen_key", "chosen",
            "--rejected_key", "rejected", "--input_template", "{}", "--train_batch_size", "8", *COMMON]
    one, ring = run_pair("rlhfkit.cli.train_dpo", [*pref, "--learning_rate", "1e-3", "--beta", "0.5"],
                         str(tmp_path / "dpo"))
    assert_same(one, ring, ["train/loss", "train/grad_norm", "train/chosen_reward", "train/acc"], [1, 2])
    one, ring = run_pair("rlhfkit.cli.train_rm", [*pref, "--learning_rate", "1e-3"], str(tmp_path / "rm"))
    assert_same(one, ring, ["train/loss", "train/grad_norm"], [1, 2])
    assert_same(one, ring, ["train/reward_mean", "train/reward_std"], [2])  # the values at the last token, step 2


def test_train_ppo(tiny_model_dir, data_dir, tmp_path):
    _gloo()
    flags = [f for f in rl_flags(tiny_model_dir, data_dir, "X", steps=2)]
    i = flags.index("--save_path")
    del flags[i:i + 2]
    one, ring = run_pair("rlhfkit.cli.train_ppo", flags, str(tmp_path))
    assert_same(one, ring, ["train/reward", "train/response_length", "train/policy_loss", "train/kl_loss",
                            "train/grad_norm", "train/entropy"], [1, 2])
    assert abs(one[0][0]["train/policy_loss"]) > 1e-4


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """The OpenRLHF-script assets: tiny llama, a PRM model with the step tag, KTO / PRM / KD data."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "openrlhf_scripts"))
    from openrlhf_assets import shared_assets

    return shared_assets(tmp_path_factory)  # the OpenRLHF-script tests' own, built once a run


OFFLINE = {  # the copies of OpenRLHF's scripts (tests/openrlhf_scripts/flat), sizes cut to 2 steps
    "train_kto": lambda a: ["--pretrain", a["MODEL"], "--dataset", f"{a['DATA']}/unpaired.jsonl", "--input_key",
                            "instruction", "--output_key", "response", "--label_key", "score", "--beta", "0.1",
                            "--max_samples", "8", "--learning_rate", "1e-3", "--gradient_checkpointing"],
    "train_prm": lambda a: ["--pretrain", a["PRM_MODEL"], "--dataset", f"{a['DATA']}/math_shepherd.jsonl",
                            "--input_key", "input", "--label_key", "value", "--packing_samples", "--placeholder_token",
                            "ки", "--reward_tokens", "+", "-", "--zero_stage", "3", "--max_samples", "8",
                            "--learning_rate", "1e-3"],
    "train_kd": lambda a: ["--pretrain", a["MODEL"], "--teacher_model", a["MODEL"], "--dataset",
                           f"{a['DATA']}/openorca.jsonl", "--input_key", "question", "--output_key", "response",
                           "--max_samples", "8", "--kd_coef", "0.4", "--zero_stage", "3", "--learning_rate", "1e-3"],
}


@pytest.mark.parametrize("cli", sorted(OFFLINE))
def test_kto_prm_kd(cli, assets, tmp_path):
    """KTO (KL reference pairs), PRM (packed, step-tag logits through the gathered full logits) and
    knowledge distillation (a frozen teacher under the ring too)."""
    _gloo()
    flags = [*OFFLINE[cli](assets), "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_len", "128",
             "--lr_warmup_ratio", "0", "--disable_progress", "--param_dtype", "fp32", "--logging_steps", "1",
             "--save_steps", "-1", "--eval_steps", "-1"]
    one, ring = run_pair(f"rlhfkit.cli.{cli}", flags, str(tmp_path))
    assert_same(one, ring, ["train/loss", "train/grad_norm"], None)
    assert one[0][0]["train/grad_norm"] > 1e-3
