"""Rollout throughput: builtin engine vs HF `generate` (dynamic and static cache), and the roofline.

    python bench/rollout.py --model qwen2-0.5b-shape --batch 64,256 --shapes 128x256,512x1024 --out rollout_h100.json
    python bench/rollout.py --model tiny --device cpu --batch 4 --shapes 16x32          # CPU smoke test
    python bench/rollout.py --batch 256 --shapes 128x256 --skip_hf --profile              # builtin only, profiled

Every engine generates `batch` sequences of `new` tokens from random `prompt`-token prompts,
sampling at temperature 1 with eos ignored, so all run to the same length; tokens/s counts new
tokens over wall time (prefill included). Each engine is warmed up first (compilation, CUDA graph
capture). The builtin's time is the median of `--repeat` generate() calls (each well under a
second, where a stray host hiccup shows); HF's runs take seconds and are timed once. The roofline of one decode step is the bytes it must read from HBM, weights once plus
the KV cache of every sequence at the mean context (prompt + new / 2), over the HBM bandwidth:

    roofline tokens/s = batch / ((weight_bytes + batch * kv_bytes_per_token * ctx) / bandwidth)

Prints one JSON line: model, device, and per (batch, shape) the tokens/s of each engine,
`speedup_vs_hf`, `speedup_vs_hf_static`, `roofline_tok_s` and the builtin's `roofline_fraction`
(end to end: its tokens/s, prefill and host work included, over the decode roofline's).
`--profile` (GPU) adds, per row, the builtin's decode step time from CUDA-graph replays at the first,
middle and final context, the kernels of one step (count and the costliest, from torch.profiler),
the time of one prefill of the whole batch and the kernels in it, and from those the split of the
wall time (`builtin_decode_step_ms_mean`, `builtin_prefill_plus_decode_ms`, `builtin_other_ms`) and
`roofline_fraction_decode_step` (the roofline step time over the mean decode step: the decode steps
alone). `--trace` adds a phase-by-phase host / GPU breakdown of one generate() with the GPU's
idle gaps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness.engine_run import prompts_for, run_builtin  # noqa: E402
from bench.harness.timing import median_ms, sync  # noqa: E402

HBM_TBPS = {"H200": 4.8, "H100": 3.35}
MODELS = {
    "qwen2-0.5b-shape": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             tie_word_embeddings=True, rope_theta=1000000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True),
}


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    """A random model of a known shape (offline), or an HF directory."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if name in MODELS:
        cfg = Qwen2Config(**MODELS[name], rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None
    return model.eval()


def attn_sweep(model, dtype: torch.dtype, batch: int, plen: int, new: int) -> list[dict]:
    """Time the Triton decode attention of one step (all layers, CUDA-graph replays) under several
    launch configurations, every row at context prompt + new / 2."""
    from rlhfkit.rollout.builtin.kernels import triton_attention

    c = model.config
    hq, kv = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // hq
    max_len, layers, dev = plen + new, c.num_hidden_layers, torch.device("cuda")
    qkv = torch.randn(batch, (hq + 2 * kv) * d, device=dev, dtype=dtype)
    q, k, v = qkv.split([hq * d, kv * d, kv * d], dim=-1)
    q, k, v = q.unflatten(-1, (hq, d)), k.unflatten(-1, (kv, d)), v.unflatten(-1, (kv, d))
    caches = [torch.randn(batch, kv, max_len, d, device=dev, dtype=dtype) for _ in range(2 * layers)]
    cos = torch.randn(max_len, d, device=dev, dtype=dtype)
    pos = torch.full((batch,), plen + new // 2, device=dev)
    saved, out = dict(triton_attention.ATTN_CONFIG), []

    def step():
        for i in range(layers):
            torch.ops.rlhfkit.decode_attention(q, k, v, caches[2 * i], caches[2 * i + 1], cos, cos, pos, d ** -0.5)

    def timed(**cfg) -> dict:
        triton_attention.ATTN_CONFIG.update(cfg)
        try:
            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            us = median_ms(lambda: [graph.replay() for _ in range(10)]) * 100 / layers
            row = {**cfg, "us_per_layer": round(us, 2)}
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler rejects
            row = {**cfg, "error": f"{type(exc).__name__}: {exc}"[:200]}
        triton_attention.ATTN_CONFIG.update(saved)
        out.append(row)
        return row

    with torch.inference_mode():
        for block_n in (32, 64, 128):
            for warps, stages in ((4, 2), (4, 3), (8, 2), (2, 2)):
                timed(block_n=block_n, num_warps=warps, num_stages=stages)
        best = min((r for r in out if "us_per_layer" in r), key=lambda r: r["us_per_layer"])
        for splits in (1, 2, 3, 4, 6):
            timed(block_n=best["block_n"], num_warps=best["num_warps"], num_stages=best["num_stages"], splits=splits)
    return out


def run_hf(model, device, ids: torch.Tensor, new: int, static: bool) -> dict:
    """HF `generate` tokens/s; `new` may be shorter than the builtin's (--hf_max_new), which can only
    flatter HF (its per-token cost grows with the context)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                           eos_token_id=None, pad_token_id=0, cache_implementation="static" if static else None)
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        # the static cache compiles for its exact length: warm it with the same run; plain: a short one
        warm_gen = gen if static else GenerationConfig(**{**gen.to_dict(), "max_new_tokens": 16})
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, generation_config=warm_gen)
        sync(device)
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        sync(device)
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    name = "hf_static" if static else "hf"
    return {f"{name}_tok_s": ids.shape[0] * new / dt, f"{name}_s": dt, f"{name}_warmup_s": warm}


def roofline(model, dtype: torch.dtype, batch: int, plen: int, new: int, tbps: float | None) -> dict:
    if not tbps:
        return {}
    elem = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * elem  # tied embeddings counted once
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * elem
    step_bytes = weight_bytes + batch * kv_per_token * (plen + new / 2)
    step_s = step_bytes / (tbps * 1e12)
    return {"roofline_tok_s": batch / step_s, "roofline_ms_per_step": 1000 * step_s,
            "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2-0.5b-shape", help="qwen2-0.5b-shape | tiny | an HF model directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default) | float32 (CPU default)")
    ap.add_argument("--batch", default="64,256", help="comma-separated batch sizes")
    ap.add_argument("--shapes", default="128x256,512x1024", help="comma-separated PROMPTxNEW")
    ap.add_argument("--engines", default="builtin,hf,hf_static", help="subset of builtin,hf,hf_static")
    ap.add_argument("--skip_hf", action="store_true", help="builtin only (same as --engines builtin)")
    ap.add_argument("--hbm_tbps", type=float, default=None, help="HBM bandwidth in TB/s (default: by GPU name)")
    ap.add_argument("--hf_max_new", type=int, default=None,
                    help="cap the HF baselines' new tokens (saves time; can only overstate HF's tokens/s)")
    ap.add_argument("--sync_every", type=int, default=16)
    ap.add_argument("--sync_every_batch", type=int, default=64, help="BuiltinEngineConfig.sync_every_batch")
    ap.add_argument("--decode_attention", default="auto", choices=["auto", "triton", "sdpa", "matmul"])
    ap.add_argument("--decode_gemm", default="auto", choices=["auto", "triton", "torch"])
    ap.add_argument("--gemm_min_rows", type=int, default=64, help="BuiltinEngineConfig.gemm_min_rows")
    ap.add_argument("--lookahead_steps", type=int, default=None, help="BuiltinEngineConfig.lookahead_steps")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed builtin generate() calls; the median is reported (all in builtin_runs_s)")
    ap.add_argument("--pdl", default="auto", choices=["auto", "on", "off"],
                    help="programmatic dependent launch of the Triton kernels (auto: Hopper and newer)")
    ap.add_argument("--no_compile_prefill", dest="compile_prefill", action="store_false")
    ap.add_argument("--compile_mode", default=None, help="torch.compile mode of the decode layer, e.g. "
                    "max-autotune-no-cudagraphs")
    ap.add_argument("--attn_sweep", action="store_true", help="time the Triton attention kernel's launch "
                    "configurations at each batch (prompt + new / 2 context) and print them")
    ap.add_argument("--no_fast_sampling", dest="fast_sampling", action="store_false",
                    help="the torch sampler instead of the Triton one")
    ap.add_argument("--profile", action="store_true", help="add decode / prefill timings and the step's kernels")
    ap.add_argument("--trace", action="store_true", help="add a phase / GPU-idle breakdown of one generate()")
    ap.add_argument("--max_prefill_tokens", type=int, default=32768)
    ap.add_argument("--no_compile", dest="compile", action="store_false")
    ap.add_argument("--no_cuda_graphs", dest="cuda_graphs", action="store_false")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    ap.add_argument("--out", default=None, help="write the JSON here (a bare name goes to bench/results/)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    engines = ["builtin"] if args.skip_hf else args.engines.split(",")
    unknown = set(engines) - {"builtin", "hf", "hf_static"}
    if unknown:
        raise SystemExit(f"--engines: unknown {sorted(unknown)}")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    from rlhfkit.rollout.builtin.kernels import triton_launch

    triton_launch.PDL_CONFIG["enabled"] = {"auto": None, "on": True, "off": False}[args.pdl]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tbps = args.hbm_tbps or next((v for k, v in HBM_TBPS.items() if k in gpu), None)
    model = build_model(args.model, device, dtype)
    results = []
    for shape in args.shapes.split(","):
        plen, new = (int(x) for x in shape.lower().split("x"))
        for batch in (int(b) for b in args.batch.split(",")):
            ids = prompts_for(batch, plen, model.config.vocab_size)
            row: dict = {"batch": batch, "prompt_len": plen, "new_tokens": new}
            if "builtin" in engines:
                row.update(run_builtin(model, device, dtype, ids, new, args))
            if args.attn_sweep and device.type == "cuda":
                try:
                    row["attn_sweep"] = attn_sweep(model, dtype, batch, plen, new)
                except Exception as exc:  # noqa: BLE001 - keep the engines' numbers
                    row["attn_sweep_error"] = f"{type(exc).__name__}: {exc}"[:500]
            for name in ("hf", "hf_static"):
                if name in engines:
                    hf_new = min(new, args.hf_max_new or new)
                    row.update(run_hf(model, device, ids, hf_new, static=name == "hf_static"))
                    row[f"{name}_new_tokens"] = hf_new
            for name in ("hf", "hf_static"):
                if "builtin_tok_s" in row and f"{name}_tok_s" in row:
                    row[f"speedup_vs_{name}"] = row["builtin_tok_s"] / row[f"{name}_tok_s"]
            row.update(roofline(model, dtype, batch, plen, new, tbps))
            if "roofline_tok_s" in row and "builtin_tok_s" in row:
                row["roofline_fraction"] = row["builtin_tok_s"] / row["roofline_tok_s"]  # end to end
            if "roofline_ms_per_step" in row and "builtin_decode_step_ms_mean" in row:  # decode steps alone
                row["roofline_fraction_decode_step"] = row["roofline_ms_per_step"] / row["builtin_decode_step_ms_mean"]
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"bench": "rollout", "model": args.model, "device": gpu, "dtype": str(dtype).replace("torch.", ""),
              "hbm_tbps": tbps, "torch": torch.__version__, "compile": args.compile,
              "decode_attention": args.decode_attention, "decode_gemm": args.decode_gemm,
              "gemm_min_rows": args.gemm_min_rows, "compile_prefill": args.compile_prefill,
              "pdl": triton_launch.use_pdl(device),
              "fast_sampling": args.fast_sampling, "sync_every": args.sync_every, "sync_every_batch": args.sync_every_batch, "compile_mode": args.compile_mode,
              "lookahead_steps": args.lookahead_steps, "repeat": args.repeat,
              "cuda_graphs": args.cuda_graphs and device.type == "cuda", "results": results}
    line = json.dumps(report)
    print(line)
    if args.out:
        path = args.out if os.path.dirname(args.out) else os.path.join(os.path.dirname(__file__), "results", args.out)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(line + "\n")
    return report


if __name__ == "__main__":
    main()
