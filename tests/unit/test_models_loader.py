"""Model/tokenizer loading: dtypes, errors that name flags, gradient checkpointing, LoRA wiring."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from rlhfkit.config.configs import ModelConfig
from rlhfkit.models.loader import (
    check_attn_implementation,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
)


def _cfg(path: str, **kw) -> ModelConfig:
    return ModelConfig(pretrain=path, param_dtype=kw.pop("param_dtype", "fp32"), **kw)


def _batch(tok):
    return tok(["hello there", "1+1=2"], return_tensors="pt", padding=True)


def test_tokenizer_pad_falls_back_to_eos(tiny_model_dir, tmp_path):
    from rlhfkit.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    loaded = load_tokenizer(str(tmp_path), padding_side="left", chat_template="{{ 'X' }}")
    assert loaded.pad_token == loaded.eos_token == "</s>"
    assert loaded.padding_side == "left" and loaded.chat_template == "{{ 'X' }}"
    assert load_tokenizer(tiny_model_dir).pad_token == "<pad>"  # an existing pad token is kept


def test_missing_path_names_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--pretrain .*no such directory"):
        load_causal_lm(_cfg(str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(_cfg(str(tmp_path)))
    with pytest.raises(ValueError, match="--pretrain is required"):
        load_causal_lm(_cfg(None))
    with pytest.raises(FileNotFoundError, match="--reward_pretrain"):
        load_tokenizer(str(tmp_path / "nope"), flag="--reward_pretrain")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_flash_attention_without_package(tiny_model_dir):
    with pytest.raises(ImportError, match="--attn_implementation flash_attention_2 needs the `flash_attn`"):
        load_causal_lm(_cfg(tiny_model_dir, attn_implementation="flash_attention_2"))


def test_attention_names():
    assert check_attn_implementation("sdpa") == "sdpa" and check_attn_implementation("eager") == "eager"
    with pytest.raises(ValueError, match="--attn_implementation must be one of"):
        check_attn_implementation("fast")


def test_4bit_without_bitsandbytes(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed (the dev extra installs it)
    with pytest.raises(ImportError, match="--load_in_4bit needs the `bitsandbytes`"):
        load_causal_lm(_cfg(tiny_model_dir, param_dtype="bf16", load_in_4bit=True, lora_rank=4))


def test_dtypes(tiny_model_dir):
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="--param_dtype must be one of"):
        resolve_dtype("int8")
    bf16 = load_causal_lm(_cfg(tiny_model_dir, param_dtype="bf16"))
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    master = load_causal_lm(_cfg(tiny_model_dir, param_dtype="bf16"), master_dtype="fp32")
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    assert master.config._attn_implementation == "sdpa"


def test_lora_all_linear(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    base = load_causal_lm(_cfg(tiny_model_dir)).eval()
    lora = load_causal_lm(_cfg(tiny_model_dir, lora_rank=4, lora_alpha=8)).eval()
    targets = set(lora.peft_config["default"].target_modules)
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # 2 layers x 7 linear layers x (A + B)
    assert len(trainable) == 2 * 7 * 2
    b = _batch(tok)
    with torch.no_grad():  # B = 0 at init: the adapted model is the base model
        torch.testing.assert_close(lora(**b).logits, base(**b).logits)
    with pytest.raises(ValueError, match="--target_modules \\['qq_proj'\\] not found"):
        load_causal_lm(_cfg(tiny_model_dir, lora_rank=4, target_modules=["qq_proj"]))


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_with_lora_gives_same_grads(tiny_model_dir, reentrant):
    """Checkpointing recomputes activations: the LoRA gradients must equal those without it."""
    tok = load_tokenizer(tiny_model_dir)
    b = _batch(tok)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = load_causal_lm(_cfg(tiny_model_dir, lora_rank=4, gradient_checkpointing=ckpt,
                                    gradient_checkpointing_use_reentrant=reentrant)).train()
        assert model.base_model.model.is_gradient_checkpointing == ckpt
        model(**b).logits.float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    lora_b = [n for n in grads[1] if "lora_B" in n]
    assert all(grads[1][n].abs().sum() > 0 for n in lora_b)  # gradients reach every adapter
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5)


def test_value_model_lora_trains_head(tiny_model_dir):
    from rlhfkit.models.value import load_value_model

    model = load_value_model(tiny_model_dir, init_value_head=True, cfg=_cfg(tiny_model_dir, lora_rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.endswith("score.modules_to_save.default.weight") for n in trainable)
    assert "score" not in model.peft_config["default"].target_modules  # the head is trained in full, not adapted
