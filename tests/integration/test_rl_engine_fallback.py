"""A model family the builtin engine lacks still runs GRPO (issue 41, part 2): a tiny random Qwen3.5
language model (gated-delta-rule linear attention and full attention layers) trains 2 steps with the
default --rollout_engine (auto), on the hf engine, and the console and train.log say so in one line;
--packing_samples is turned off for it with one line too (its linear attention state would run
across packed samples). An explicit --rollout_engine builtin refuses before any model loads."""

from __future__ import annotations

import math
import os

import pytest
import torch
import transformers
from helpers import rl_flags, write_rl_data

from rlhfkit.cli import train_ppo


@pytest.fixture(scope="module")
def tiny_qwen3_5_dir(tmp_path_factory) -> str:
    """A 2-layer Qwen3.5 text model (one linear attention layer, one full) with the character tokenizer."""
    cls = getattr(transformers, "Qwen3_5TextConfig", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    from rlhfkit.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 max_position_embeddings=256, layer_types=["linear_attention", "full_attention"],
                 pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = str(tmp_path_factory.mktemp("tiny_qwen3_5"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_grpo_on_qwen3_5_runs_on_the_hf_engine_with_one_line(tiny_qwen3_5_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rlhfkit.rollout.choice.is_installed", lambda name: False)  # the same line with vllm around
    d = write_rl_data(str(tmp_path), num_prompts=4)
    run_dir = os.path.join(tmp_path, "run")
    hist = train_ppo.main(rl_flags(tiny_qwen3_5_dir, d, os.path.join(tmp_path, "model"), "--run_dir", run_dir,
                                   "--packing_samples"))
    assert [h["step"] for h in hist] == [1, 2]
    assert all(math.isfinite(h["train/policy_loss"]) and h["train/response_length"] > 0 for h in hist)
    out = capsys.readouterr().out
    with open(os.path.join(run_dir, "train.log")) as f:
        log = f.read()
    for text in (out, log):
        engine = [line for line in text.splitlines() if "rollout engine: " in line]
        assert len(engine) == 1 and "rollout engine: hf (auto: " in engine[0] and "'qwen3_5_text'" in engine[0]
        packing = [line for line in text.splitlines() if "--packing_samples is off" in line]
        assert len(packing) == 1 and "linear_attention layers" in packing[0]
    assert os.path.isfile(os.path.join(tmp_path, "model", "model.safetensors"))


def test_an_explicit_builtin_refuses_the_model(tiny_qwen3_5_dir, tmp_path, capsys):
    d = write_rl_data(str(tmp_path), num_prompts=4)
    argv = rl_flags(tiny_qwen3_5_dir, d, os.path.join(tmp_path, "model"), "--run_dir", os.path.join(tmp_path, "run"),
                    "--rollout_engine", "builtin")
    with pytest.raises(SystemExit):
        train_ppo.main(argv)
    err = capsys.readouterr().err
    assert "--rollout_engine builtin cannot run this model" in err and "'qwen3_5_text'" in err
