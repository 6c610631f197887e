"""The Triton routed-experts kernels (rlhfkit/rollout/builtin/kernels/triton_moe.py) on a GPU (skipped without CUDA).

One random routed layer in bf16 goes through `experts._moe` twice, once with the Triton kernels (router and
experts, each expert program finding its own rows) and once with F.linear, the counting sort and torch's grouped GEMMs; both are compared with the same
layer in fp32 on the tokens both send where fp32 does. The Triton path must be as close to fp32 as the other is
(25% slack over its error, plus 1e-3) and choose the same experts for at least 99% of the tokens (its router
logits sum in another order, so near-ties may fall the other way), for Qwen3-MoE's SiLU experts and gpt-oss's
clamped, biased, interleaved ones, at batch sizes from one token to several rows per expert (300 tokens: more
rows per expert than a program's block, and more rows than one scan of the ids takes).
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layer(act: str, dtype: torch.dtype, h: int = 256, i: int = 96, e: int = 16, k: int = 4):
    from rlhfkit.rollout.builtin.model.families import MoESpec

    bias = act != "silu"
    moe = MoESpec(num_experts=e, top_k=k, intermediate_size=i, router="topk_softmax" if bias else "softmax_topk",
                  bias=bias, norm_topk_prob=not bias, act=act)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    lw = types.SimpleNamespace(router=rnd(e, h, scale=h ** -0.5), router_bias=rnd(e, scale=0.1) if bias else None,
                               experts_gate_up=rnd(e, 2 * i, h, scale=h ** -0.5),
                               experts_gate_up_bias=rnd(e, 2 * i, scale=0.1) if bias else None,
                               experts_down=rnd(e, h, i, scale=i ** -0.5),
                               experts_down_bias=rnd(e, h, scale=0.1) if bias else None)
    return lw, types.SimpleNamespace(moe=moe)


@pytest.mark.parametrize("act", ["silu", "clamped_swiglu"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_triton_experts_as_close_to_fp32_as_grouped_gemms(act, tokens, monkeypatch):
    from rlhfkit.rollout.builtin.kernels import triton_moe
    from rlhfkit.rollout.builtin.model import experts

    lw32, spec = _layer(act, torch.float32)
    lw16 = types.SimpleNamespace(**{k: None if v is None else v.to(torch.bfloat16) for k, v in vars(lw32).items()})
    x = torch.randn(tokens, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    with experts.record_routing() as ids32:
        ref = experts._moe(lw32, spec, x).float()
    monkeypatch.setattr(triton_moe, "MAX_ROWS_PER_EXPERT", 1 << 30)
    assert triton_moe.use_for(tokens * spec.moe.top_k, spec.moe.num_experts, x.bfloat16())
    with experts.record_routing() as ids_triton:
        fast = experts._moe(lw16, spec, x.bfloat16()).float()
    monkeypatch.setattr(triton_moe, "MAX_ROWS_PER_EXPERT", 0)
    with experts.record_routing() as ids_grouped:
        grouped = experts._moe(lw16, spec, x.bfloat16()).float()
    def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.sort(-1).values == b.sort(-1).values).all(-1)

    assert same(ids_triton[0], ids_grouped[0]).float().mean() >= 0.99
    # tokens both bf16 routers send where fp32 does: only there is the comparison fair
    rows = same(ids_triton[0], ids32[0]) & same(ids_grouped[0], ids32[0])
    assert rows.float().mean() > 0.8
    err_fast = (fast - ref)[rows].abs().max().item()
    err_grouped = (grouped - ref)[rows].abs().max().item()
    assert err_fast <= 1.25 * err_grouped + 1e-3, (err_fast, err_grouped)
