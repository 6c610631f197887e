"""A user's first runs with their own model (issue 45), end to end on the tiny model:

- `--load_checkpoint` with no checkpoint to resume never replaces an earlier run: one line, exit 1, before
  any model loads, in every trainer; the refusal of a folder holding a run without checkpoints does not
  suggest it;
- rows cut at `--max_len` are counted once at load, and logged as `data/cut_rows`;
- a full fine-tune (and a LoRA merge) is saved in the base model's dtype, not in the fp32 of CPU training.
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

from rlhfkit.cli import train_sft
from rlhfkit.trainers.metrics import read_metrics


def write_qa(path, n: int = 32, long_every: int = 0) -> str:
    """Rows `a+b=` -> `a+b`; every `long_every`-th answer is 40 characters long (tokens: one a character)."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 9, (i * 7) % 11
            answer = str(a + b) + ("x" * 40 if long_every and i % long_every == 0 else "")
            f.write(json.dumps({"q": f"{a}+{b}=", "a": answer}) + "\n")
    return str(path)


def sft(model, data, out, *extra):
    return ["--pretrain", model, "--dataset", data, "--input_key", "q", "--output_key", "a", "--input_template", "{}",
            "--max_len", "16", "--train_batch_size", "8", "--micro_train_batch_size", "8", "--max_steps", "2",
            "--learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--param_dtype", "fp32", "--save_path", out,
            "--disable_progress", "--device", "cpu", *extra]


def error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


# ----------------------------------------------------------------------------- --load_checkpoint


def test_load_checkpoint_of_a_run_without_checkpoints_keeps_that_run(tiny_model_dir, tmp_path, capsys):
    data, out = write_qa(tmp_path / "d.jsonl"), str(tmp_path / "run")
    train_sft.main(sft(tiny_model_dir, data, out))  # --save_steps -1: no checkpoint
    files = {n: open(os.path.join(out, n), "rb").read() for n in ("metrics.jsonl", "model.safetensors")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_sft.main(sft(tiny_model_dir, data, out, "--load_checkpoint", "--max_steps", "4"))
    assert e.value.code == 1 and error_lines(capsys) == [
        f"train_sft: error: --load_checkpoint: --ckpt_path {out}/checkpoints holds no checkpoint to resume, and "
        f"--save_path {out} holds an earlier run (2 logged steps in {out}/metrics.jsonl; a saved model in {out}) that "
        "saved none (checkpoints are written every --save_steps steps and when a run is stopped): start over with "
        "--overwrite_output_dir instead, or choose another --save_path"]
    assert {n: open(os.path.join(out, n), "rb").read() for n in files} == files  # nothing replaced
    with pytest.raises(SystemExit):  # the refusal without the flag suggests only what leads somewhere
        train_sft.main(sft(tiny_model_dir, data, out))
    (line,) = error_lines(capsys)
    assert line.endswith("and no checkpoint to resume: start over with --overwrite_output_dir, or choose another "
                         "--save_path") and "--load_checkpoint" not in line


def _trainer_argv(module: str, model: str, out: str) -> list[str]:
    data = "--prompt_data" if module.startswith("train_ppo") else "--dataset"
    return ["--pretrain", model, data, os.path.join(out, "no_such_data.jsonl"), "--save_path", out,
            "--load_checkpoint"]


@pytest.mark.parametrize("module", ["train_sft", "train_rm", "train_dpo", "train_kto", "train_prm", "train_kd",
                                    "train_ppo", "train_ppo_ray"])
def test_every_trainer_refuses_to_resume_nothing_over_an_earlier_run(module, tmp_path, capsys):
    out = str(tmp_path / "run")
    os.makedirs(out)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n')
    # --pretrain names no model and --dataset no file: the line comes before either is read
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"rlhfkit.cli.{module}").main(_trainer_argv(module, str(tmp_path / "none"), out))
    lines = error_lines(capsys)
    assert e.value.code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"{module}: error: --load_checkpoint: --ckpt_path {out}/checkpoints holds no "
                               "checkpoint to resume, and --save_path"), lines
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]


# ----------------------------------------------------------------------------- rows cut at --max_len


def test_rows_cut_at_max_len_are_reported_once_and_logged(tiny_model_dir, tmp_path, capsys):
    data, out = write_qa(tmp_path / "d.jsonl", n=32, long_every=4), str(tmp_path / "run")
    history = train_sft.main(sft(tiny_model_dir, data, out))
    captured = capsys.readouterr()
    said = [ln for ln in (captured.out + captured.err).splitlines() if "cut at --max_len" in ln]
    assert said == [f"--dataset {data}: 8 of 32 rows cut at --max_len 16; their end token not trained "
                    f"(the first: {data} row 1)"], said
    assert [h["data/cut_rows"] for h in history] == [8.0, 8.0]
    assert [r["data/cut_rows"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [8.0, 8.0]


# ----------------------------------------------------------------------------- saved dtype


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny Llama stored in bf16 (config.json says so, as a bf16 model from the hub does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny_bf16"))
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def saved_dtypes(path: str) -> set[torch.dtype]:
    from safetensors.torch import load_file

    return {t.dtype for t in load_file(os.path.join(path, "model.safetensors")).values()}


def test_a_cpu_full_fine_tune_of_a_bf16_model_is_saved_in_bf16(bf16_model_dir, tmp_path):
    data, out = write_qa(tmp_path / "d.jsonl"), str(tmp_path / "run")
    train_sft.main(sft(bf16_model_dir, data, out))  # CPU training computes in fp32
    assert saved_dtypes(out) == {torch.bfloat16}
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    assert size <= os.path.getsize(os.path.join(bf16_model_dir, "model.safetensors")) * 1.01  # not twice the base
    asked = str(tmp_path / "run32")  # unless asked
    train_sft.main(sft(bf16_model_dir, data, asked) + ["--save_dtype", "fp32"])
    assert saved_dtypes(asked) == {torch.float32}


def test_a_lora_merge_keeps_the_base_model_dtype(bf16_model_dir, tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    from rlhfkit.cli import lora_combiner

    data, adapter = write_qa(tmp_path / "d.jsonl"), str(tmp_path / "lora")
    train_sft.main(sft(bf16_model_dir, data, adapter, "--lora_rank", "4", "--lora_alpha", "8"))
    merged = lora_combiner.main(["--model_path", bf16_model_dir, "--lora_path", adapter,
                                 "--output_path", str(tmp_path / "merged")])
    assert saved_dtypes(merged) == {torch.bfloat16}
    fp32 = lora_combiner.main(["--model_path", tiny_model_dir, "--lora_path", adapter,
                               "--output_path", str(tmp_path / "merged32")])  # the base's dtype, not bf16
    assert saved_dtypes(fp32) == {torch.float32}
    asked = lora_combiner.main(["--model_path", tiny_model_dir, "--lora_path", adapter, "--param_dtype", "bf16",
                                "--output_path", str(tmp_path / "merged16")])  # unless the user asks
    assert saved_dtypes(asked) == {torch.bfloat16}
