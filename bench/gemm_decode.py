"""The decode step's projections at small M: cuBLAS (what F.linear runs) against the builtin
engine's Triton GEMMs (`rlhfkit/rollout/builtin/kernels/triton_gemm.py`) over their launch parameters.

    python bench/gemm_decode.py [--rows 64,256] [--out bench/results/gemm_decode_h100.json]

Every variant is timed as a CUDA graph of `layers` calls, each on its own weight tensor (24
layers of weights do not fit in L2, as in the real step), median of 5 replays, in microseconds per
call. Shapes: Qwen2-0.5B (hidden 896, intermediate 4864, 14 / 2 heads of 64).
gate_up is compared as GEMM + SiLU-mul (the cuBLAS path needs a second kernel for the
SiLU-mul; it is timed compiled, as the engine runs it) against the fused Triton kernel; o and down
as GEMM against split-K partials (whose sum the next RMSNorm kernel absorbs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhfkit.rollout.builtin.kernels import triton_gemm  # noqa: E402

HIDDEN, INTER, QKV = 896, 4864, 1152


def graph_us(fn, layers: int) -> float:
    """Median microseconds per call of `fn(i)` for i in range(layers), replayed as one CUDA graph."""
    for i in range(layers):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1000 / layers)
    return sorted(times)[len(times) // 2]


def sweep_mm(x: torch.Tensor, ws: list[torch.Tensor], layers: int) -> list[dict]:
    n, k = ws[0].shape
    ref = F.linear(x, ws[0]).float()
    rows = []
    split_opts = [s for s in (1, 2, 4, 7, 8) if k % (s * 32) == 0]
    for s, bm, bn, bk, (warps, stages) in itertools.product(split_opts, (64, 128), (32, 64, 128), (64, 128),
                                                            ((4, 3), (4, 4), (8, 3))):
        if (k // s) % bk or (bm == 128 and bn == 128 and warps == 4):
            continue
        triton_gemm.GEMM_CONFIG["mm"] = {"splits": s, "block_m": bm, "block_n": bn, "block_k": bk,
                                         "num_warps": warps, "num_stages": stages}
        try:
            got = torch.ops.rlhfkit.mm_partials(x, ws[0]).sum(0)
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            us = graph_us(lambda i: torch.ops.rlhfkit.mm_partials(x, ws[i]), layers)
            rows.append({"splits": s, "block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
                         "num_stages": stages, "us": round(us, 2), "rel_err": float(f"{err:.2e}")})
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler rejects
            rows.append({"splits": s, "block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
                         "num_stages": stages, "error": f"{type(exc).__name__}: {exc}"[:160]})
    triton_gemm.GEMM_CONFIG["mm"] = {}
    return rows


def sweep_gate_up(x: torch.Tensor, ws: list[torch.Tensor], layers: int) -> list[dict]:
    g, u = F.linear(x, ws[0]).chunk(2, dim=-1)
    ref = (F.silu(g.float()) * u.float())
    rows = []
    for bm, bn, bk, (warps, stages) in itertools.product((64, 128), (32, 64, 128), (64, 128),
                                                         ((4, 3), (4, 4), (8, 2), (8, 3))):
        if bm == 128 and bn == 128 and warps == 4:
            continue
        triton_gemm.GEMM_CONFIG["gate_up"] = {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
                                              "num_stages": stages}
        try:
            got = torch.ops.rlhfkit.gate_up_silu(x, ws[0]).float()
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            us = graph_us(lambda i: torch.ops.rlhfkit.gate_up_silu(x, ws[i]), layers)
            rows.append({"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
                         "us": round(us, 2), "rel_err": float(f"{err:.2e}")})
        except Exception as exc:  # noqa: BLE001
            rows.append({"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
                         "error": f"{type(exc).__name__}: {exc}"[:160]})
    triton_gemm.GEMM_CONFIG["gate_up"] = {}
    return rows


def probe(dev: str, dt: torch.dtype, silu_mul) -> list[dict]:
    rows = []
    m = 32768  # 256 prompts x 128 tokens: one prefill of the rollout benchmark
    x = torch.randn(m, HIDDEN, device=dev, dtype=dt)
    ws = [torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt) * 0.02 for _ in range(4)]
    row = {"m": m, "shape": "prefill gate_up+silu", "tflop": 2 * m * HIDDEN * 2 * INTER / 1e12,
           "cublas_us": round(graph_us(lambda i: F.linear(x, ws[i]), 4), 1),
           "cublas_plus_silu_us": round(graph_us(lambda i: silu_mul(F.linear(x, ws[i])), 4), 1), "sweep": []}
    for bm, bn, bk, warps, stages in ((128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4),
                                      (64, 128, 64, 4, 3), (128, 128, 32, 8, 4), (256, 64, 64, 8, 3)):
        triton_gemm.GEMM_CONFIG["gate_up"] = {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
                                              "num_stages": stages}
        try:
            us = graph_us(lambda i: torch.ops.rlhfkit.gate_up_silu(x, ws[i]), 4)
            row["sweep"].append({"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
                                 "num_stages": stages, "us": round(us, 1)})
        except Exception as exc:  # noqa: BLE001
            row["sweep"].append({"block_m": bm, "block_n": bn, "error": f"{type(exc).__name__}: {exc}"[:120]})
    triton_gemm.GEMM_CONFIG["gate_up"] = {}
    rows.append(row)
    print(json.dumps(row), flush=True)
    for m in (64, 256):
        x = torch.randn(m, HIDDEN, device=dev, dtype=dt)
        ws = [torch.randn(QKV, HIDDEN, device=dev, dtype=dt) * 0.02 for _ in range(24)]
        row = {"m": m, "shape": "qkv split-K", "cublas_us": round(graph_us(lambda i: F.linear(x, ws[i]), 24), 2),
               "sweep": []}
        for s_, bn, warps, stages in ((2, 64, 4, 4), (2, 32, 4, 4), (7, 32, 8, 3), (7, 64, 4, 3), (1, 32, 4, 4)):
            triton_gemm.GEMM_CONFIG["mm"] = {"splits": s_, "block_m": 64, "block_n": bn, "block_k": 64,
                                             "num_warps": warps, "num_stages": stages}
            try:
                us = graph_us(lambda i: torch.ops.rlhfkit.mm_partials(x, ws[i]), 24)
                row["sweep"].append({"splits": s_, "block_n": bn, "num_warps": warps, "num_stages": stages,
                                     "us": round(us, 2)})
            except Exception as exc:  # noqa: BLE001
                row["sweep"].append({"splits": s_, "error": f"{type(exc).__name__}: {exc}"[:120]})
        triton_gemm.GEMM_CONFIG["mm"] = {}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def best(rows: list[dict], top: int = 5) -> list[dict]:
    return sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sampler_only", action="store_true", help="only the sampler's launch parameters")
    ap.add_argument("--probe", action="store_true", help="only the candidates for later work: the fused gate/up + "
                    "SiLU kernel at prefill size (M = 32768) against cuBLAS + SiLU-mul, and split-K qkv at decode size")
    a = ap.parse_args()
    dev, dt, layers = "cuda", torch.bfloat16, a.layers
    torch.manual_seed(0)
    out = {"bench": "gemm_decode", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "layers": layers, "results": []}
    silu_mul = torch.compile(lambda y: F.silu(y[:, :INTER]) * y[:, INTER:])
    if a.probe:
        out["results"] = probe(dev, dt, silu_mul)
        print(json.dumps(out))
        if a.out:
            with open(a.out, "w") as f:
                f.write(json.dumps(out) + "\n")
        return
    for m in map(int, a.rows.split(",")) if not a.sampler_only else ():
        x = torch.randn(m, HIDDEN, device=dev, dtype=dt)
        xi = torch.randn(m, INTER, device=dev, dtype=dt)
        for name, n, k, inp in (("o", HIDDEN, HIDDEN, x), ("down", HIDDEN, INTER, xi), ("qkv", QKV, HIDDEN, x)):
            ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
            row = {"m": m, "shape": name, "n": n, "k": k, "weight_mb": round(n * k * 2 / 2**20, 2),
                   "cublas_us": round(graph_us(lambda i: F.linear(inp, ws[i]), layers), 2),
                   "default_splits": triton_gemm.splits_for(n, k),
                   "default_us": round(graph_us(lambda i: torch.ops.rlhfkit.mm_partials(inp, ws[i]), layers), 2)}
            if name != "qkv":  # qkv feeds the attention kernel, which takes no partials: cuBLAS only
                sweep = sweep_mm(inp, ws, layers)
                row["triton_best"] = best(sweep)
                row["triton_best_by_splits"] = {s: best([r for r in sweep if r.get("splits") == s], 1)
                                                for s in sorted({r["splits"] for r in sweep})}
                row["triton_errors"] = [r for r in sweep if "error" in r][:3]
            out["results"].append(row)
            print(json.dumps(row), flush=True)
        ws = [torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
        silu_mul(F.linear(x, ws[0]))
        row = {"m": m, "shape": "gate_up+silu", "n": 2 * INTER, "k": HIDDEN,
               "cublas_us": round(graph_us(lambda i: F.linear(x, ws[i]), layers), 2),
               "cublas_plus_silu_us": round(graph_us(lambda i: silu_mul(F.linear(x, ws[i])), layers), 2),
               "default_us": round(graph_us(lambda i: torch.ops.rlhfkit.gate_up_silu(x, ws[i]), layers), 2)}
        sweep = sweep_gate_up(x, ws, layers)
        row["triton_best"] = best(sweep)
        row["triton_errors"] = [r for r in sweep if "error" in r][:3]
        out["results"].append(row)
        print(json.dumps(row), flush=True)
    from rlhfkit.rollout.builtin.kernels import triton_sampling

    block0, warps0 = triton_sampling.SAMPLE_BLOCK, triton_sampling.SAMPLE_WARPS
    for m in map(int, a.rows.split(",")):  # the sampler's one pass over [M, V] logits
        logits = torch.randn(m, 151936, device=dev, dtype=dt) * 3
        temp = torch.ones(m, device=dev)
        stop = torch.zeros(m, 8, dtype=torch.long, device=dev)
        ban = torch.zeros(m, 8, dtype=torch.bool, device=dev)
        row = {"m": m, "shape": "sampler_partials", "logit_mb": round(logits.numel() * 2 / 2**20, 1), "sweep": []}
        ref = torch.ops.rlhfkit.sample_partials(logits, temp, stop, ban)
        for block, warps in itertools.product((1024, 2048, 4096), (4, 8, 16)):
            triton_sampling.SAMPLE_BLOCK, triton_sampling.SAMPLE_WARPS = block, warps
            try:
                got = torch.ops.rlhfkit.sample_partials(logits, temp, stop, ban)
                same = bool(torch.equal(got[1], ref[1]) and torch.allclose(got[3], ref[3], rtol=1e-4))
                us = graph_us(lambda i: torch.ops.rlhfkit.sample_partials(logits, temp, stop, ban), 8)
                row["sweep"].append({"block": block, "num_warps": warps, "us": round(us, 2), "same": same})
            except Exception as exc:  # noqa: BLE001
                row["sweep"].append({"block": block, "num_warps": warps, "error": f"{type(exc).__name__}: {exc}"[:160]})
        triton_sampling.SAMPLE_BLOCK, triton_sampling.SAMPLE_WARPS = block0, warps0
        out["results"].append(row)
        print(json.dumps(row), flush=True)
    line = json.dumps(out)
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
