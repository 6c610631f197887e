"""One routed-experts layer of the builtin engine on a GPU: the Triton decode kernels against torch's grouped GEMMs.

    python bench/moe_kernels.py --out moe_kernels_h100.json

For each shape (the families bench's Qwen3-MoE and gpt-oss layers, Qwen3-30B-A3B's layer) and each number
of tokens T, one layer `experts.routed` (routing, dispatch, expert GEMMs, weighted sum; compiled as in
the engine) is captured in a CUDA graph and replayed: once with the Triton kernels (triton_moe.py) and
once with torch._grouped_mm; the same layer without its expert GEMMs (routing and the weighted sum, with
torch's dispatch or, for the Triton path, none) shows what is left around them. Beside them, a dense MLP holding the same weight bytes (the Qwen2 twin's
layer: cuBLAS GEMMs, and the engine's Triton decode GEMMs where they apply), and the time it takes
to read the expert weights once at the measured copy bandwidth. Times are microseconds per layer,
the median of 5 rounds of 50 replays. One JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import types

import torch
import torch.nn.functional as F

from rlhfkit.rollout.builtin.kernels import triton_gemm, triton_moe
from rlhfkit.rollout.builtin.model import experts
from rlhfkit.rollout.builtin.model.families import MoESpec

SHAPES = {
    "qwen3_moe_bench": dict(hidden=1024, inter=256, experts=64, top_k=8, act="silu", bias=False),
    "gpt_oss_bench": dict(hidden=1024, inter=1024, experts=32, top_k=4, act="clamped_swiglu", bias=True),
    "qwen3_30b_a3b": dict(hidden=2048, inter=768, experts=128, top_k=8, act="silu", bias=False),
}


def _graph_time(fn, rounds: int = 5, replays: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(times)


def _copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = _graph_time(lambda: b.copy_(a))
    return 2 * a.numel() / (us * 1e-6)  # bytes read and written per second


def layer(shape: dict, dtype: torch.dtype) -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
    h, i, e = shape["hidden"], shape["inter"], shape["experts"]
    router = "topk_softmax" if shape["bias"] else "softmax_topk"
    moe = MoESpec(num_experts=e, top_k=shape["top_k"], intermediate_size=i, router=router, bias=shape["bias"],
                  norm_topk_prob=not shape["bias"], act=shape["act"])
    dev = "cuda"
    lw = types.SimpleNamespace(
        router=torch.randn(e, h, device=dev, dtype=dtype) / h ** 0.5,
        router_bias=torch.randn(e, device=dev, dtype=dtype) / 10 if shape["bias"] else None,
        experts_gate_up=torch.randn(e, 2 * i, h, device=dev, dtype=dtype) / h ** 0.5,
        experts_gate_up_bias=torch.randn(e, 2 * i, device=dev, dtype=dtype) / 10 if shape["bias"] else None,
        experts_down=torch.randn(e, h, i, device=dev, dtype=dtype) / i ** 0.5,
        experts_down_bias=torch.randn(e, h, device=dev, dtype=dtype) / 10 if shape["bias"] else None)
    return lw, types.SimpleNamespace(moe=moe)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 1024, 4096])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = torch.bfloat16
    bandwidth = _copy_bandwidth()
    result = {"bench": "moe_kernels", "gpu": torch.cuda.get_device_name(), "gpus": 1, "dtype": "bf16",
              "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "rows": []}
    for name in args.shapes:
        shape = SHAPES[name]
        lw, spec = layer(shape, dtype)
        h, i, e = shape["hidden"], shape["inter"], shape["experts"]
        expert_bytes = (lw.experts_gate_up.numel() + lw.experts_down.numel()) * 2
        dense_gate_up = torch.randn(2 * e * i, h, device="cuda", dtype=dtype) / h ** 0.5
        dense_down = torch.randn(h, e * i, device="cuda", dtype=dtype) / (e * i) ** 0.5
        for t in args.tokens:
            x = torch.randn(t, h, device="cuda", dtype=dtype)
            row: dict = {"shape": name, **shape, "tokens": t, "rows_per_expert": t * shape["top_k"] / e,
                         "read_experts_once_us": round(expert_bytes / bandwidth * 1e6, 1)}
            keep = triton_moe.MAX_ROWS_PER_EXPERT
            for label, limit in (("triton_us", 1 << 30), ("grouped_mm_us", 0)):
                triton_moe.MAX_ROWS_PER_EXPERT = limit
                try:
                    row[label] = round(_graph_time(lambda: experts.routed(lw, spec, x)), 1)
                except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
                    row[label] = f"{type(exc).__name__}: {exc}"[:300]
            triton_moe.MAX_ROWS_PER_EXPERT = keep
            triton_moe.MAX_ROWS_PER_EXPERT = 1 << 30
            ref_moe = experts._moe(lw, spec, x)
            triton_moe.MAX_ROWS_PER_EXPERT = 0
            row["triton_vs_grouped_max_abs"] = float((ref_moe.float() - experts._moe(lw, spec, x).float()).abs().max())
            triton_moe.MAX_ROWS_PER_EXPERT = keep

            def routing_only() -> torch.Tensor:  # the layer without its expert GEMMs: route, dispatch, combine
                moe = spec.moe
                weights, ids = experts.route(F.linear(x, lw.router, lw.router_bias), moe)
                dest, perm, _ = experts.dispatch(ids, moe.num_experts)
                y = x[perm // moe.top_k][dest].view(-1, moe.top_k, h) * weights[..., None]
                return y.sum(dim=1).to(x.dtype)

            row["routing_only_us"] = round(_graph_time(torch.compile(routing_only, dynamic=False)), 1)
            if triton_moe.available():
                def routing_triton() -> torch.Tensor:  # the Triton path's router and weighted sum (no dispatch)
                    moe = spec.moe
                    weights, ids = torch.ops.rlhfkit.moe_route(x, lw.router, lw.router_bias, moe.top_k,
                                                               moe.router == "softmax_topk", moe.norm_topk_prob)
                    y = x.repeat_interleave(moe.top_k, 0).view(-1, moe.top_k, h) * weights[..., None]
                    return y.sum(dim=1).to(x.dtype)

                row["routing_triton_us"] = round(_graph_time(torch.compile(routing_triton, dynamic=False)), 1)

            def dense_cublas() -> torch.Tensor:
                g, u = F.linear(x, dense_gate_up).chunk(2, dim=-1)
                return F.linear(F.silu(g) * u, dense_down)

            row["dense_twin_cublas_us"] = round(_graph_time(torch.compile(dense_cublas, dynamic=False)), 1)
            if triton_gemm.available():
                def dense_triton() -> torch.Tensor:
                    act = torch.ops.rlhfkit.gate_up_silu(x, dense_gate_up)
                    return torch.ops.rlhfkit.mm_partials(act, dense_down).sum(0).to(dtype)

                row["dense_twin_triton_us"] = round(_graph_time(dense_triton), 1)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
