"""models/fused_qkv.py on CUDA: the fused k/v GEMM in a bf16 Qwen2 model, eager and compiled, against
two GEMMs (ENABLED = False) on the same weights, both measured against the fp32 model: the fused
path's error is no larger than the unfused one's (bf16 rounding of differently ordered sums); the
backend fuses by default on the GPU.

    pytest -q tests/gpu/test_fused_qkv_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlhfkit.models import fused_qkv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(model, ids, enabled: bool, monkeypatch):
    monkeypatch.setattr(fused_qkv, "ENABLED", enabled)
    monkeypatch.setattr(fused_qkv, "DEVICE_TYPES", ("cuda",))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_equals_unfused_bf16(monkeypatch, compiled):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=1000, max_position_embeddings=256)
    torch.manual_seed(0)
    exact = AutoModelForCausalLM.from_config(cfg).cuda()
    model = copy.deepcopy(exact).to(torch.bfloat16)
    assert fused_qkv.fuse_qkv(model) == 2
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    ids = torch.randint(0, 1000, (4, 128), device="cuda")
    ex_logits, ex_grads = _run(exact, ids, False, monkeypatch)
    ref_logits, ref_grads = _run(model, ids, False, monkeypatch)
    logits, grads = _run(model, ids, True, monkeypatch)

    def err(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    assert err(logits, ex_logits) <= 1.5 * err(ref_logits, ex_logits) + 1e-4
    for name, g in ex_grads.items():
        assert err(grads[name], g) <= 1.5 * err(ref_grads[name], g) + 1e-3, name


def test_backend_fuses_on_gpu():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.backend.dist import DistInfo
    from rlhfkit.config.configs import BackendConfig

    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256, vocab_size=500)
    backend = FSDP2Backend(AutoModelForCausalLM.from_config(cfg), BackendConfig(param_dtype="bf16", device="cuda"),
                           None, 1, DistInfo(device="cuda"))
    assert all(type(layer.self_attn.k_proj) is fused_qkv.FusedKProj for layer in backend.model.model.layers)
