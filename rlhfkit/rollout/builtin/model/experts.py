"""The builtin engine's routed experts (mixture-of-experts layers: Qwen3-MoE, gpt-oss).

Each token's router logits pick its top k experts (`route`); the T x k (token, expert) rows are grouped by
expert with a counting sort (`dispatch`), run through two grouped GEMMs (`grouped_linear`: torch._grouped_mm)
and summed back per token with the router weights, in the reference model's order of rounding. In a GPU
decode step, with few rows per expert, the Triton kernels of kernels/triton_moe.py route, and their expert
programs find their own rows, so nothing is grouped or reordered.
`routed` is that layer, compiled on CUDA even in an eager decode step (kernels/eager_fused.py):
eagerly it is a dozen small kernels. `record_routing()` collects every eager MoE layer's choices, so tests
and benchmarks can check that the engine routes tokens as the trainer does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlhfkit.rollout.builtin.kernels import triton_moe
from rlhfkit.rollout.builtin.kernels.eager_fused import EagerFused
from rlhfkit.rollout.builtin.model.families import MoESpec
from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.rollout.builtin.model.weights import LayerWeights

_ROUTE_LOG: list[torch.Tensor] | None = None


class record_routing:
    """`with record_routing() as log:` appends each eager MoE layer's expert choices `[T, k]`
    (in layer order) to `log` (for tests and benchmarks that compare them with the trainer's)."""

    def __enter__(self) -> list[torch.Tensor]:
        global _ROUTE_LOG
        self.prev, _ROUTE_LOG = _ROUTE_LOG, []
        return _ROUTE_LOG

    def __exit__(self, *exc: Any) -> None:
        global _ROUTE_LOG
        _ROUTE_LOG = self.prev


def route(logits: torch.Tensor, moe: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E]` -> (weights `[T, k]` in the logits' dtype, expert ids `[T, k]`):
    top k of the softmax (renormalised with `norm_topk_prob`), or the softmax of the top k logits."""
    if moe.router == "softmax_topk":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids
    top, ids = torch.topk(logits, moe.top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `x [S, K]` sorted by expert (`offsets [E]`: cumulative rows per expert, `experts [S]`:
    each row's expert) times their expert's `weight [E, N, K]` -> `[S, N]`: one grouped GEMM
    (`torch._grouped_mm`). On CUDA it takes bf16 only; other dtypes there (fp32 tests) gather each
    row's matrix instead."""
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        out = torch.bmm(weight[experts], x.unsqueeze(-1)).squeeze(-1)
    else:
        out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return out if bias is None else out + bias[experts]


def _expert_act(moe: MoESpec, gate_up: torch.Tensor) -> torch.Tensor:
    if moe.act == "silu":
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    # gpt-oss: gate and up interleaved, both clamped, gate * sigmoid(alpha gate) * (up + 1)
    gate, up = gate_up[..., ::2].clamp(max=moe.swiglu_limit), gate_up[..., 1::2].clamp(-moe.swiglu_limit,
                                                                                         moe.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))


def dispatch(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the S = T x k (token, choice) rows of `ids [T, k]` by expert, stably, without a sort
    (a counting sort: one-hot prefix sums, a few fused kernels where `torch.sort` launches several):
    returns `dest [S]` (each row's place in expert order), `perm [S]` (the row at each place, the
    inverse of dest) and `offsets [E]` (cumulative rows per expert, int32, for the grouped GEMMs)."""
    flat = ids.reshape(-1)
    onehot = F.one_hot(flat, num_experts).to(torch.int32)  # [S, E]
    counts = onehot.sum(0)
    rank = (onehot.cumsum(0) * onehot).sum(1) - 1  # rows of the same expert before this one
    dest = (counts.cumsum(0) - counts)[flat] + rank
    perm = torch.empty_like(dest).index_copy_(0, dest, torch.arange(dest.shape[0], device=dest.device))
    return dest, perm, counts.cumsum(0, dtype=torch.int32)


def _moe(layer: LayerWeights, spec: ModelSpec, h: torch.Tensor) -> torch.Tensor:
    """Routed experts over `h [..., H]`: route each token to k experts, group the T x k (token,
    expert) rows by expert (`dispatch`), two grouped GEMMs, then each token's k rows in their
    routing order, weighted by the router and summed (so the sum rounds as the reference model's does)."""
    moe, router, gate_up, down = spec.moe, layer.router, layer.experts_gate_up, layer.experts_down
    assert moe is not None and router is not None and gate_up is not None and down is not None, "a routed layer"
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    fast = triton_moe.use_for(x.shape[0] * moe.top_k, moe.num_experts, x)  # a GPU decode step: Triton kernels
    if fast:
        weights, ids = torch.ops.rlhfkit.moe_route(x, router, layer.router_bias, moe.top_k,
                                                   moe.router == "softmax_topk", moe.norm_topk_prob)
    else:
        weights, ids = route(F.linear(x, router, layer.router_bias), moe)
    if _ROUTE_LOG is not None and not torch.compiler.is_compiling():
        _ROUTE_LOG.append(ids.detach().clone())
    if fast:
        kind = triton_moe.ACT_SILU if moe.act == "silu" else triton_moe.ACT_GPT_OSS
        act = torch.ops.rlhfkit.moe_gate_up(x, ids, gate_up, layer.experts_gate_up_bias, moe.top_k, kind,
                                            moe.swiglu_alpha, moe.swiglu_limit)
        out = torch.ops.rlhfkit.moe_down(act, ids, down)  # (token, k) order: the kernels find each expert's rows
        if layer.experts_down_bias is not None:
            out = out + layer.experts_down_bias[ids.reshape(-1)]
    else:
        dest, perm, offsets = dispatch(ids, moe.num_experts)
        experts = ids.reshape(-1)[perm]  # each grouped row's expert
        act = _expert_act(moe, grouped_linear(x[perm // moe.top_k], gate_up, offsets, experts,
                                              layer.experts_gate_up_bias))
        out = grouped_linear(act, down, offsets, experts, layer.experts_down_bias)[dest]  # (token, k) order
    out = out.view(-1, moe.top_k, shape[-1]) * weights[..., None]
    return out.sum(dim=1).to(h.dtype).reshape(shape)


# the experts eagerly are a dozen small kernels (routing, the counting sort, the weighted sum): a
# Qwen3-MoE decode step ran 2.5x slower than with them compiled (kernels/eager_fused.py)
routed = EagerFused(_moe, bypass=lambda: _ROUTE_LOG is not None)
