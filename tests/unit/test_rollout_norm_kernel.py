"""The Triton RMSNorm kernels (`rlhfkit::rms_norm`, `rlhfkit::add_rms_norm`) against the engine's torch
RMSNorm in each family's rounding, on strided views (a slice of the fused QKV output and its heads) and on
a residual add. Runs on CUDA, and on CPU under TRITON_INTERPRET=1 with Triton installed; skipped otherwise."""

from __future__ import annotations

import os

import pytest
import torch

from rlhfkit.rollout.builtin.kernels import triton_norm
from rlhfkit.rollout.builtin.model.decoder import rms_norm


def _devices() -> list[str]:
    out = []
    if torch.cuda.is_available() and triton_norm.triton is not None:
        out.append("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1" and triton_norm.triton is not None:
        out.append("cpu")
    return out


pytestmark = pytest.mark.skipif(not _devices(), reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """One rounding step apart at most (the kernel sums the squares in another order than torch), in bf16 on
    a GPU nearly all equal (the same roundings, not merely close), in fp32 within a few ulps. Triton's CPU interpreter rounds to bf16 by
    truncation, not to nearest as GPUs do, so there only the tolerance holds, at two steps."""
    assert a.shape == b.shape and a.dtype == b.dtype
    gap = (a.float() - b.float()).abs()
    rel = 1e-2 if a.is_cuda else 2e-2
    assert (gap <= rel * b.float().abs() + 1e-3).all(), gap.max()
    if a.dtype == torch.float32:  # no rounding to absorb the order of the sum and rsqrt's last bit
        assert (gap <= 1e-5 * b.float().abs() + 1e-6).all(), gap.max()
    elif a.is_cuda:
        assert (gap == 0).float().mean() > 0.95, (gap == 0).float().mean()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("style", list(triton_norm.STYLES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_of_strided_rows_and_heads(device, style, dtype):
    g = torch.Generator().manual_seed(0)
    heads, d, kv = 4, 64, 2
    qkv = (torch.randn(5, (heads + 2 * kv) * d, generator=g) * 3).to(device, dtype)
    q = qkv[:, :heads * d]  # rows strided by the fused output's width
    wq = (torch.randn(heads * d, generator=g) * 0.1 + 1).to(device, dtype)
    got = torch.ops.rlhfkit.rms_norm(q, wq, 1e-6, triton_norm.STYLES[style])
    _close(got, rms_norm(q, wq, 1e-6, style))
    qh = q.unflatten(-1, (heads, d))  # [B, Hq, D]: rows strided twice (OLMo's full norm vs Gemma's per head)
    wh = wq[:d].contiguous()
    _close(torch.ops.rlhfkit.rms_norm(qh, wh, 1e-6, triton_norm.STYLES[style]), rms_norm(qh, wh, 1e-6, style))
    qp = qh.reshape(1, 5, heads, d).expand(2, 5, heads, d)  # prefill's [b, P, Hq, D]
    _close(torch.ops.rlhfkit.rms_norm(qp, wh, 1e-6, triton_norm.STYLES[style]), rms_norm(qp, wh, 1e-6, style))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("style", list(triton_norm.STYLES))
@pytest.mark.parametrize("hidden", [256, 1152, 3000])
def test_add_then_norm(device, style, hidden):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, hidden, generator=g).to(device, torch.bfloat16)
    delta = (torch.randn(7, hidden, generator=g) * 4).to(device, torch.bfloat16)
    w = (torch.randn(hidden, generator=g) * 0.1).to(device, torch.bfloat16)
    x_new, h = torch.ops.rlhfkit.add_rms_norm(x, delta, w, 1e-6, triton_norm.STYLES[style])
    if x.is_cuda:
        assert torch.equal(x_new, x + delta)  # the sum rounds as torch's add does
    _close(x_new, x + delta)
    _close(h, rms_norm(x + delta, w, 1e-6, style))


def test_refuses_mismatched_delta():
    if triton_norm.triton is None:
        pytest.skip("needs Triton")
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="must match x"):
        torch.ops.rlhfkit.add_rms_norm(x, torch.zeros(2, 4), torch.ones(8), 1e-6, 0)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("style", ["fp32", "gemma"])
def test_fp32_weight_on_bf16_rows(device, style):
    """gpt-oss keeps its norm weights in fp32: where the family scales in fp32 anyway the kernel takes them
    (one kernel instead of the eager chain) and rounds as the torch norm does."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 512, generator=g) * 3).to(device, torch.bfloat16)
    delta = torch.randn(6, 512, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(512, generator=g) * 0.1 + 1).to(device, torch.float32)
    assert triton_norm.applies(x, w, style) == (device == "cuda")
    _close(torch.ops.rlhfkit.rms_norm(x, w, 1e-6, triton_norm.STYLES[style]), rms_norm(x, w, 1e-6, style))
    x_new, h = torch.ops.rlhfkit.add_rms_norm(x, delta, w, 1e-6, triton_norm.STYLES[style])
    _close(h, rms_norm(x + delta, w, 1e-6, style))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels take CUDA tensors only")
def test_applies_takes_fp32_weights_only_where_the_family_scales_in_fp32():
    """A Llama-style norm with an fp32 weight would come out fp32 from torch: the kernel leaves it alone."""
    x, w = torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda"), torch.ones(8, device="cuda")
    assert triton_norm.applies(x, w, "fp32") and triton_norm.applies(x, w, "gemma")
    assert not triton_norm.applies(x, w, "llama")
    assert not triton_norm.applies(x.float(), w.bfloat16(), "fp32")  # a weight of lower precision than the rows
