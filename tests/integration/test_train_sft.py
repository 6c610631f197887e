"""train_sft end to end on the tiny model: the seed's command, loss falls, reload, resume, bad rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rlhfkit.cli import train_sft
from rlhfkit.trainers.metrics import read_metrics

SEED_FLAGS = [  # OpenRLHF's README SFT command (minus --use_wandb: no network here)
    "--max_len", "4096", "--input_key", "question", "--output_key", "response",
    "--input_template", "User: {}\nAssistant: ", "--train_batch_size", "256", "--micro_train_batch_size", "2",
    "--max_samples", "500000", "--save_steps", "-1", "--logging_steps", "1", "--eval_steps", "-1",
    "--zero_stage", "2", "--max_epochs", "1", "--packing_samples", "--param_dtype", "bf16",
    "--learning_rate", "5e-6", "--gradient_checkpointing",
]


def write_qa(path, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = torch.randint(0, 50, (2,), generator=g).tolist()
            f.write(json.dumps({"question": f"{a}+{b}=", "response": str(a + b)}) + "\n")
    return path


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    d = tmp_path_factory.mktemp("qa")
    return write_qa(str(d / "train.jsonl"), 512), write_qa(str(d / "eval.jsonl"), 64, seed=1)


def sft_args(model, data, out, *extra):
    return ["--pretrain", model, "--dataset", data, "--input_key", "question", "--output_key", "response",
            "--input_template", "{}", "--max_len", "32", "--train_batch_size", "16", "--micro_train_batch_size", "8",
            "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--save_path", out, "--disable_progress",
            "--attn_implementation", "eager", *extra]


def test_seed_sft_command_runs_on_cpu(tiny_long_model_dir, qa, tmp_path):
    out = str(tmp_path / "sft")
    data = write_qa(str(tmp_path / "seed.jsonl"), 256)  # one optimizer step of the seed's batch of 256
    cmd = [sys.executable, "-m", "rlhfkit.cli.train_sft", "--pretrain", tiny_long_model_dir, "--dataset", data,
           "--save_path", out, "--disable_progress", *SEED_FLAGS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [x["step"] for x in rows] == [1] and rows[0]["train/loss"] > 0
    cfg = json.load(open(os.path.join(out, "run_config.json")))
    assert cfg["packing_samples"] and cfg["train_batch_size"] == 256
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_loss_falls_over_50_steps_and_model_reloads(tiny_model_dir, qa, tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "sft")
    steps = []
    train_sft.run(train_sft.build_parser().parse(sft_args(tiny_model_dir, qa[0], out, "--max_epochs", "2",
                                                          "--max_steps", "50", "--eval_dataset", qa[1],
                                                          "--eval_steps", "25", "--param_dtype", "fp32")),
                  on_step_end=lambda s, m, b: steps.append(m))
    losses = [m["loss"] for m in steps]
    assert len(losses) == 50
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert os.path.isfile(os.path.join(out, "metrics.png"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    m2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(model(ids).logits, m2(ids).logits)
    # the export holds the trained weights, not the initial ones
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not torch.allclose(base(ids).logits, model(ids).logits)


class Crash(Exception):
    pass


def test_killed_then_resumed_equals_uninterrupted(tiny_model_dir, qa, tmp_path):
    from safetensors.torch import load_file

    common = ["--max_epochs", "2", "--max_steps", "6", "--save_steps", "2", "--param_dtype", "fp32"]
    full = str(tmp_path / "full")
    train_sft.run(train_sft.build_parser().parse(
        sft_args(tiny_model_dir, qa[0], full, *common, "--ckpt_path", str(tmp_path / "ck_full"))))

    part = str(tmp_path / "part")
    ck = str(tmp_path / "ck_part")

    def crash_after_3(state, metrics, backend):
        if state.step == 3:  # after the step-2 checkpoint, before the step-4 one
            raise Crash()

    with pytest.raises(Crash):
        train_sft.run(train_sft.build_parser().parse(
            sft_args(tiny_model_dir, qa[0], part, *common, "--ckpt_path", ck)), on_step_end=crash_after_3)
    assert sorted(os.listdir(ck)) == ["global_step2", "latest"]
    assert [r["step"] for r in read_metrics(os.path.join(part, "metrics.jsonl"))] == [1, 2, 3]
    train_sft.run(train_sft.build_parser().parse(
        sft_args(tiny_model_dir, qa[0], part, *common, "--ckpt_path", ck, "--load_checkpoint")))
    # step 3 was logged by the killed run after the step-2 checkpoint: logged once, by the resumed run
    resumed = read_metrics(os.path.join(part, "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    full_rows = read_metrics(os.path.join(full, "metrics.jsonl"))
    assert resumed[2]["train/loss"] == pytest.approx(full_rows[2]["train/loss"], rel=1e-6)
    a = load_file(os.path.join(full, "model.safetensors"))
    b = load_file(os.path.join(part, "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_missing_input_key_names_file_row_and_key(tiny_model_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "response": "2"}) + "\n"
                    + json.dumps({"prompt": "2+2=", "response": "4"}) + "\n")
    cmd = [sys.executable, "-m", "rlhfkit.cli.train_sft", *sft_args(tiny_model_dir, str(data), str(tmp_path / "o"))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "bad.jsonl row 2" in r.stderr and "'question'" in r.stderr and "--input_key" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_flag_fails_with_suggestion(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "rlhfkit.cli.train_sft", "--pretrain", tiny_model_dir,
                        "--micro_train_batchsize", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "did you mean --micro_train_batch_size" in r.stderr


def test_a_ring_larger_than_the_world_is_refused_by_name(tiny_model_dir, qa, tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlhfkit.cli.train_sft",
                        *sft_args(tiny_model_dir, qa[0], str(tmp_path / "o")), "--ring_attn_size", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "must be divisible by" in r.stderr and "--ring_attn_size (2)" in r.stderr
    assert "Traceback" not in r.stderr


def test_max_steps_takes_that_many_steps_cycling_the_data(tiny_model_dir, tmp_path, capsys):
    """16 rows in batches of 8 are 2 steps an epoch; --max_epochs 1 --max_steps 5 takes 5 optimizer
    steps over epochs 0, 0, 1, 1, 2 (as Hugging Face's Trainer: max_steps overrides the epochs), says
    so in one line, and the LR schedule spans the 5 steps (linear: the 5th step's rate is 1/5 of the peak)."""
    data = write_qa(str(tmp_path / "small.jsonl"), 16)
    out = str(tmp_path / "sft")
    args = sft_args(tiny_model_dir, data, out, "--train_batch_size", "8", "--max_epochs", "1", "--max_steps", "5",
                    "--lr_scheduler", "linear", "--param_dtype", "fp32")
    hist = train_sft.main(args)
    assert [r["step"] for r in hist] == [1, 2, 3, 4, 5]
    assert [r["train/epoch"] for r in hist] == [0, 0, 1, 1, 2]
    assert hist[-1]["train/lr"] == pytest.approx(3e-3 / 5)
    assert "--max_steps 5: 2.5 passes over the data" in capsys.readouterr().out
