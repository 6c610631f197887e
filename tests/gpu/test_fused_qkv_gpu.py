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
    return out.logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


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
    from rlhfkit.parallel.dist import DistInfo
    from rlhfkit.config.configs import BackendConfig

    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256, vocab_size=500)
    backend = FSDP2Backend(AutoModelForCausalLM.from_config(cfg), BackendConfig(param_dtype="bf16", device="cuda"),
                           None, 1, DistInfo(device="cuda"))
    assert all(type(layer.self_attn.k_proj) is fused_qkv.FusedKProj for layer in backend.model.model.layers)


_FSDP_WORKER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel import init_distributed
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.models import fused_qkv

fused_qkv.ENABLED = sys.argv[1] == "1"
dist = init_distributed("cuda")
cfg = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=1000, max_position_embeddings=256)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)
b = FSDP2Backend(model, BackendConfig(param_dtype="bf16", device="cuda", zero_stage=3),
                 OptimConfig(learning_rate=1e-3, lr_warmup_ratio=0.0), 10, dist)
assert b.is_sharded and type(b.model.model.layers[0].self_attn.k_proj) is fused_qkv.FusedKProj
g = torch.Generator().manual_seed(1)
losses, norms = [], {}
for step in range(3):
    ids = torch.randint(0, 1000, (4, 64), generator=g).cuda()
    loss = b.model(input_ids=ids, labels=ids).loss
    b.backward(loss)
    if step == 0:
        for n, p in b.model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            norms[n] = float(grad.float().norm())
    b.optimizer_step()
    losses.append(float(loss))
print(json.dumps([losses, norms]))
"""


def test_fsdp2_sharded_fused_equals_unfused(tmp_path):
    """The sharded path (FSDP2 over a one-rank process group: DTensor parameters at rest, plain ones in
    the forward) with k/v fused trains like the unfused one."""
    import json
    import os
    import socket
    import subprocess
    import sys

    def run(enabled: str) -> list:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        out = subprocess.run([sys.executable, "-c", _FSDP_WORKER, enabled], env=env, capture_output=True,
                             text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                 os.path.abspath(__file__)))))
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    (fused, fused_norms), (plain, plain_norms) = run("1"), run("0")
    assert plain[-1] < plain[0]  # it trains
    assert fused == pytest.approx(plain, rel=1e-2)
    assert fused_norms.keys() == plain_norms.keys()
    for name, want in plain_norms.items():  # every gradient arrives, k's and v's included
        assert want > 0 and fused_norms[name] == pytest.approx(want, rel=2e-2), name
