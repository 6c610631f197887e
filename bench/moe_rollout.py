"""Rollout of a large mixture-of-experts shape on one GPU: the builtin engine beside the HF engine.

    python bench/moe_rollout.py --out moe_rollout_h100.json                  # Qwen3-30B-A3B's shape, random bf16
    python bench/moe_rollout.py --layers 24 --out moe_rollout_15b_h100.json  # half its depth
    python bench/moe_rollout.py --tiny --device cpu                          # CPU smoke test

The shape is Qwen3-30B-A3B's (hidden 2048, 48 layers, 32 query / 4 KV heads of 128, 128 experts of
width 768, 8 per token, a 151936-token vocabulary: 30.5B parameters, 3.3B active per token) with
random weights: the builtin engine draws its own on the GPU from the config (no module, no file), and
the HF engine (rlhfkit.rollout.hf_engine, transformers `generate` with its grouped-GEMM experts) gets
a transformers model built on the GPU from the same config. The two never hold weights at the same
time (61 GB each in bf16). Both generate `--batch` sequences of `--new` tokens from `--prompt`-token
prompts, temperature 1, eos ignored; tokens/s counts new tokens over wall time, after a warm-up
generation. One JSON line: the shape, parameters, and each engine's tokens/s, time and peak memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig  # noqa: E402
from rlhfkit.types import GenerationRequest, SamplingParams  # noqa: E402

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)


def config_of(a: argparse.Namespace):
    from transformers import Qwen3MoeConfig

    shape = {**QWEN3_30B_A3B, **(TINY if a.tiny else {})}
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    return Qwen3MoeConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def counts(config) -> tuple[int, int]:
    """(total, active per token) parameters."""
    h, layers, v = config.hidden_size, config.num_hidden_layers, config.vocab_size
    d, q, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    attn = h * d * (2 * q + 2 * kv) + 2 * d
    expert = 3 * h * config.moe_intermediate_size
    per_layer = attn + h * config.num_experts + 2 * h
    emb = v * h * (1 if config.tie_word_embeddings else 2)
    total = emb + layers * (per_layer + config.num_experts * expert) + h
    active = emb + layers * (per_layer + config.num_experts_per_tok * expert) + h
    return total, active


def requests(batch: int, plen: int, new: int, vocab: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, min_new_tokens=new)
    return [GenerationRequest(torch.randint(10, vocab, (plen,), generator=g).tolist(), sp, i) for i in range(batch)]


def timed(engine, reqs: list[GenerationRequest], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert all(len(o[0].token_ids) == reqs[0].params.max_new_tokens for o in outs)
    return time.perf_counter() - t0


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def run_builtin(config, a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    t0 = time.perf_counter()
    engine = BuiltinEngine(config, None, device=device, dtype=dtype, eos_token_ids=[],
                           config=BuiltinEngineConfig(max_num_seqs=a.batch, max_model_len=a.prompt + a.new))
    build = time.perf_counter() - t0
    warm = requests(a.batch, a.prompt, 16, config.vocab_size)
    t0 = time.perf_counter()
    engine.generate(warm)
    warm_s = time.perf_counter() - t0
    dt = timed(engine, requests(a.batch, a.prompt, a.new, config.vocab_size), device)
    out = {"builtin_tok_s": a.batch * a.new / dt, "builtin_s": dt, "builtin_build_s": build,
           "builtin_warmup_s": warm_s, "builtin_peak_gib": peak_gib(device),
           "builtin_attention": engine.model.attn, "builtin_compile_error": engine.runner.compile_error}
    engine.close()
    del engine
    return out


def run_hf(config, a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    from rlhfkit.rollout.hf_engine import HFEngine

    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    build = time.perf_counter() - t0
    engine = HFEngine(model, None, device=device, max_batch_size=a.batch, eos_token_ids=[], pad_token_id=0)
    t0 = time.perf_counter()
    engine.generate(requests(a.batch, a.prompt, 16, config.vocab_size))
    warm_s = time.perf_counter() - t0
    dt = timed(engine, requests(a.batch, a.prompt, a.hf_new or a.new, config.vocab_size), device)
    out = {"hf_tok_s": a.batch * (a.hf_new or a.new) / dt, "hf_s": dt, "hf_build_s": build, "hf_warmup_s": warm_s,
           "hf_new_tokens": a.hf_new or a.new, "hf_peak_gib": peak_gib(device),
           "hf_experts_implementation": getattr(model.config, "_experts_implementation", None)}
    del engine, model
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=0, help="override the depth (0: the shape's 48)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--hf_new", type=int, default=0, help="new tokens for the HF engine (0: --new); fewer only "
                                                         "flatters HF, whose per-token cost grows with the context")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = config_of(a)
    total, active = counts(config)
    res = {"bench": "moe_rollout", "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "gpus": 1 if device.type == "cuda" else 0, "shape": "tiny" if a.tiny else "qwen3-30b-a3b",
           "layers": config.num_hidden_layers, "params_total": total, "params_active": active,
           "batch": a.batch, "prompt": a.prompt, "new": a.new, "dtype": str(dtype).replace("torch.", "")}

    def write() -> None:
        print(json.dumps(res), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    try:
        res.update(run_builtin(config, a, device, dtype))
    except Exception as exc:  # noqa: BLE001 - reported in the JSON; the HF side still runs
        res["builtin_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    write()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if not a.skip_hf:
        try:
            res.update(run_hf(config, a, device, dtype))
        except Exception as exc:  # noqa: BLE001
            res["hf_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        if "builtin_tok_s" in res and "hf_tok_s" in res:
            res["speedup_vs_hf"] = res["builtin_tok_s"] / res["hf_tok_s"]
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
