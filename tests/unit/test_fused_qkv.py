"""models/fused_qkv.py: one GEMM for k and v gives the unfused model's outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.models import fused_qkv


def _qwen2(seed: int = 0, bias: bool = True):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      intermediate_size=96, vocab_size=101, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if not bias:
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, name).bias = None
    return model


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(fused_qkv, "DEVICE_TYPES", ("cpu",))


class _LinearCalls:
    """Counts F.linear calls by output width."""

    def __init__(self, monkeypatch):
        self.widths: list[int] = []
        orig = F.linear

        def counting(x, w, b=None):
            self.widths.append(w.shape[0])
            return orig(x, w, b)

        monkeypatch.setattr(F, "linear", counting)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_outputs_and_grads(ref, model, ids, monkeypatch) -> list[int]:
    """Forward + backward of both on `ids`: logits and every gradient equal within fp32 rounding; returns
    the output widths of the fused model's F.linear calls."""
    a = ref(input_ids=ids, labels=ids)
    a.loss.backward()
    calls = _LinearCalls(monkeypatch)
    b = model(input_ids=ids, labels=ids)
    b.loss.backward()
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    ga, gb = _grads(ref), _grads(model)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-6, msg=name)
    return calls.widths


@pytest.mark.parametrize("bias", [True, False])
def test_fused_matches_unfused_outputs_and_grads(on_cpu, monkeypatch, bias):
    ref = _qwen2(bias=bias)
    model = copy.deepcopy(ref)
    assert fused_qkv.fuse_qkv(model) == 2
    assert fused_qkv.fuse_qkv(model) == 2  # idempotent
    assert list(model.state_dict()) == list(ref.state_dict())  # names and checkpoints unchanged
    widths = _same_outputs_and_grads(ref, model, torch.randint(0, 101, (3, 12)), monkeypatch)
    # per layer: q_proj and o_proj (64 outputs), one k/v GEMM (2 x 16), gate, up, down
    assert widths.count(32) == 2 and widths.count(16) == 0


def test_off_device_types_and_disabled_leave_the_gemms_alone(monkeypatch):
    model = _qwen2()
    fused_qkv.fuse_qkv(model)
    ids = torch.randint(0, 101, (2, 8))
    calls = _LinearCalls(monkeypatch)
    model(input_ids=ids)  # DEVICE_TYPES is ("cuda",): on the CPU the GEMMs run as before
    assert calls.widths.count(16) == 4 and calls.widths.count(32) == 0
    monkeypatch.setattr(fused_qkv, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(fused_qkv, "ENABLED", False)
    calls.widths.clear()
    model(input_ids=ids)
    assert calls.widths.count(16) == 4


def test_v_proj_called_with_another_input_computes_its_own(on_cpu):
    model = _qwen2()
    fused_qkv.fuse_qkv(model)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    torch.testing.assert_close(attn.k_proj(x), F.linear(x, attn.k_proj.weight, attn.k_proj.bias))  # stashes v(x)
    torch.testing.assert_close(attn.v_proj(y), F.linear(y, attn.v_proj.weight, attn.v_proj.bias))
    assert attn.v_proj._kv_stash == []  # the stale slice is dropped
    torch.testing.assert_close(attn.v_proj(x), F.linear(x, attn.v_proj.weight, attn.v_proj.bias))
    attn.k_proj(x)
    torch.testing.assert_close(attn.v_proj(x), F.linear(x, attn.v_proj.weight, attn.v_proj.bias))
    assert attn.v_proj._kv_stash == []


def test_mismatched_layers_are_not_fused():
    model = _qwen2()
    attn = model.model.layers[0].self_attn
    attn.k_proj.bias = None  # v keeps its own
    assert fused_qkv.fuse_qkv(model) == 1
    assert type(attn.k_proj) is torch.nn.Linear and type(attn.v_proj) is torch.nn.Linear


def test_compiled_block_fused_matches_eager_unfused(on_cpu):
    pytest.importorskip("torch._inductor")
    ref = _qwen2(seed=1)
    model = copy.deepcopy(ref)
    fused_qkv.fuse_qkv(model)
    # one compiled block beside an eager one; dynamo and AOT autograd trace the fused projection and its stash
    # as inductor would be handed them (aot_eager: the graphs run eagerly, without inductor's C++ build, 45 s here)
    model.model.layers[0].compile(backend="aot_eager")
    ids = torch.randint(0, 101, (2, 16))
    a = ref(input_ids=ids, labels=ids)
    a.loss.backward()
    try:
        b = model(input_ids=ids, labels=ids)
    except Exception as e:  # no C++ compiler for inductor's CPU code on this machine
        if "compil" in str(e).lower() and "fused_qkv" not in str(e):
            pytest.skip(f"torch.compile unavailable on CPU here: {type(e).__name__}")
        raise
    b.loss.backward()
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-5)
    for name, g in _grads(ref).items():
        torch.testing.assert_close(_grads(model)[name], g, rtol=1e-4, atol=1e-5, msg=name)
    assert all(layer.self_attn.v_proj._kv_stash == [] for layer in model.model.layers)


def test_lora_base_layers_fused(on_cpu, monkeypatch):
    peft = pytest.importorskip("peft")
    ref = _qwen2(seed=2)
    ref = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # adapters that change the output
    model = copy.deepcopy(ref)
    assert fused_qkv.fuse_qkv(model) == 2
    assert list(model.state_dict()) == list(ref.state_dict())
    widths = _same_outputs_and_grads(ref, model, torch.randint(0, 101, (2, 10)), monkeypatch)
    # k and v base layers: one GEMM per layer; the 16-wide GEMMs left are v_proj's lora_B
    assert widths.count(32) == 2 and widths.count(16) == 2
