"""train_kd end to end: a tiny Llama student distils a (sharpened) tiny Qwen2 teacher with the same tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from rlhfkit.cli.train_kd import build_parser, main, run
from rlhfkit.config.configs import ModelConfig
from rlhfkit.models.loader import load_causal_lm


def sharp_teacher(src: str, dst: str) -> str:
    """The tiny Qwen2 with its output layer scaled x8: peaked token distributions far from the student's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def test_kd_loss_falls(tiny_model_dir, tiny_qwen2_dir, tmp_path):
    teacher = sharp_teacher(tiny_qwen2_dir, str(tmp_path / "teacher"))
    path = str(tmp_path / "sft.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(json.dumps({"q": f"{a}+{b}=", "a": str(a + b)}) for a in range(6) for b in range(6)) + "\n")
    out = str(tmp_path / "kd")
    args = build_parser().parse([
        "--pretrain", tiny_model_dir, "--teacher_model", teacher, "--teacher_offload", "--dataset", path,
        "--eval_dataset", path, "--input_key", "q", "--output_key", "a", "--kd_coef", "0.5", "--packing_samples",
        "--train_batch_size", "12", "--micro_train_batch_size", "6", "--max_epochs", "100", "--max_steps", "15",
        "--eval_steps", "15", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--max_len", "64",
        "--save_path", out, "--disable_progress"])
    result = run(args)
    task = result.task
    batches = [task.collate(result.eval_items[i:i + 12]) for i in range(0, len(result.eval_items), 12)]
    start = task.eval_metrics(load_causal_lm(ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32")).eval(), batches)
    end = result.state.history[-1]
    assert end["step"] == 15
    assert end["eval/loss"] < 0.8 * start["eval/loss"], (start, end)
    assert end["eval/kd_loss"] < start["eval/kd_loss"] and end["eval/nll_loss"] < start["eval/nll_loss"]
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_missing_teacher_is_one_clear_error(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--pretrain", tiny_model_dir, "--dataset", "x.jsonl"])
    assert e.value.code == 1 and "train_kd: error: --teacher_model is required" in capsys.readouterr().err
