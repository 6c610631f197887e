"""The Triton decode-attention kernel (`rlhfkit::decode_attention`) against the engine's torch path, for
every feature the families need: grouped-query heads, sliding windows, attention sinks, partial rotary,
head_dim 256 (Gemma 3) and the split-K (flash-decoding) merge. Runs on CUDA, and on CPU under
TRITON_INTERPRET=1 with Triton installed; skipped otherwise."""

from __future__ import annotations

import os

import pytest
import torch

from rlhfkit.rollout.builtin.kernels import triton_attention
from rlhfkit.rollout.builtin.model.decoder import _torch_decode_attention
from rlhfkit.rollout.builtin.model.families import LayerKind
from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.rollout.builtin.model.weights import LayerWeights


def _interpreter_index_fix() -> None:
    """Triton's interpreter converts a loop bound held as a one-element array with int(), which numpy 2
    refuses; read it with .item() instead (interpreter only)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1" and triton_attention.triton is not None:
    _interpreter_index_fix()


def _devices() -> list[str]:
    out = []
    if torch.cuda.is_available() and triton_attention.triton is not None:
        out.append("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1" and triton_attention.triton is not None:
        out.append("cpu")
    return out


CASES = [  # (heads, kv heads, head_dim, window, sinks, rotary_dim, rows, splits)
    (4, 2, 64, None, False, None, 3, 1),
    (4, 2, 64, 8, False, None, 3, 1),
    (4, 1, 256, 8, False, None, 2, 1),  # Gemma 3 270M's heads
    (4, 2, 64, 8, True, None, 3, 1),  # gpt-oss
    (4, 2, 64, None, True, None, 2, 3),  # sinks across splits: the merge kernel adds them
    (4, 2, 64, 8, False, 32, 2, 2),  # partial rotary, a window and splits
    (8, 8, 32, None, False, None, 4, 1),
]


@pytest.mark.skipif(not _devices(), reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_the_torch_path(device, case, monkeypatch):
    hq, kv, d, window, sinks, rot, rows, splits = case
    monkeypatch.setitem(triton_attention.ATTN_CONFIG, "splits", splits)
    monkeypatch.setattr(triton_attention, "_num_sms", lambda index: 132)
    g = torch.Generator().manual_seed(0)
    max_len = 40
    spec = ModelSpec("qwen2", 100, hq * d, 1, hq, kv, d, 8, 1e-6, False, False, max_len, rotary_dim=rot)
    layer = LayerWeights(qkv=torch.empty(0), o=torch.empty(0), kind=LayerKind(window=window),
                         sinks=torch.randn(hq, generator=g).to(device) if sinks else None)
    q = torch.randn(rows, hq, d, generator=g).to(device)
    k = torch.randn(rows, kv, d, generator=g).to(device)
    v = torch.randn(rows, kv, d, generator=g).to(device)
    cache_k = torch.randn(rows, kv, max_len, d, generator=g).to(device)
    cache_v = torch.randn(rows, kv, max_len, d, generator=g).to(device)
    pos = torch.tensor([5, 23, 37, 0][:rows], device=device)
    theta = torch.arange(max_len)[:, None] * (0.1 ** torch.arange(d // 2))[None, :]
    cos, sin = torch.cat([theta.cos()] * 2, -1).to(device), torch.cat([theta.sin()] * 2, -1).to(device)
    if rot is not None:  # partial rotary: the tables hold cos 1, sin 0 past rot
        cos[:, rot:], sin[:, rot:] = 1.0, 0.0
        cos[:, :rot] = torch.cat([theta[:, :rot // 2].cos()] * 2, -1)
        sin[:, :rot] = torch.cat([theta[:, :rot // 2].sin()] * 2, -1)
    kc, vc = cache_k.clone(), cache_v.clone()
    out = torch.ops.rlhfkit.decode_attention(q, k, v, kc, vc, cos, sin, pos, d ** -0.5, window or 0,
                                             layer.sinks, rot or 0)
    j = torch.arange(max_len, device=device)[None, :]
    hidden = (j > pos[:, None]) | ((j <= pos[:, None] - window) if window else torch.zeros_like(j, dtype=torch.bool))
    bias = torch.zeros(hidden.shape, device=device).masked_fill(hidden, float("-inf"))[:, None, None, :]
    rk, rv = cache_k.clone(), cache_v.clone()
    ref = _torch_decode_attention(spec, layer, q, k, v, rk, rv, pos, cos, sin, bias, d ** -0.5, use_sdpa=False)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    rows_idx = torch.arange(rows, device=device)
    torch.testing.assert_close(kc[rows_idx, :, pos], rk[rows_idx, :, pos], rtol=1e-5, atol=1e-5)  # the new K written
    torch.testing.assert_close(vc, rv)
