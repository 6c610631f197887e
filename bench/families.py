"""The builtin engine on the families beyond Llama: bf16 parity with transformers and rollout throughput
beside a Qwen2 shape of equal size.

    python bench/families.py --out families_h100.json                      # every family, ~0.5-1.5B shapes
    python bench/families.py --families gemma3_text --batch 64 --out g.json
    python bench/families.py --tiny --device cpu                            # CPU smoke test (tiny shapes)

Per family (SHAPES: a real model's shape where one exists at this size, else a 0.5-1B one in the
family's proportions):
- parity: a random bf16 model (transformers' own config class and init) on the GPU; the engine as a
  user gets it (compiled, CUDA graphs) generates 32 greedy tokens for 8 prompts; for each prompt,
  whether the tokens equal transformers' `generate`, where they first differ, and the largest gap
  between the engine's log-probs and transformers' log-softmax on the engine's own tokens
  (teacher-forced), the number a bf16 tolerance is stated for; and both bf16 computations (engine,
  transformers) against transformers in fp32 on the same weights and tokens. MoE families also give the share of
  (token, expert) choices the engine's router makes as transformers' does, over the prompts and the
  generated tokens (an eager engine's prefill, record_routing).
- throughput (the engine as a user gets it: eager kernels replayed as CUDA graphs): bench/rollout.py's builtin measurement (batch x prompt / new tokens, temperature 1,
  eos ignored, median of --repeat generate() calls) for the family and for its Qwen2 twin: the same
  hidden size, layers, heads, head_dim and vocabulary with a dense MLP widened to the family's total
  parameter count; `ratio_vs_qwen2` = Qwen2 twin tokens/s over the family's (1.0: as fast).

Prints one JSON line per family and writes them all to --out, with the GPU's name.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness

from bench.harness.engine_run import prompts_for, run_builtin  # noqa: E402
from bench.harness.timing import sync  # noqa: E402

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig  # noqa: E402
from rlhfkit.rollout.builtin.model.experts import record_routing, route  # noqa: E402
from rlhfkit.rollout.builtin.model.spec import ModelSpec  # noqa: E402
from rlhfkit.types import GenerationRequest, SamplingParams  # noqa: E402

SHAPES = {  # ~0.5-1.5B shapes; real models' dimensions where one exists at this size
    "gemma3_text": dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=512, max_position_embeddings=32768, tie_word_embeddings=True),  # Gemma 3 1B
    "qwen3_moe": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=256,
                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                      num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=32768,
                      tie_word_embeddings=True),
    "gpt_oss": dict(vocab_size=201088, hidden_size=1024, intermediate_size=1024, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=32,
                    num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072),
    "phi3": dict(vocab_size=32064, hidden_size=1536, intermediate_size=4096, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                 partial_rotary_factor=0.75),
    "olmo2": dict(vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096),  # OLMo 2 1B
    "olmo3": dict(vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=65536,
                  sliding_window=4096),
}
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            intermediate_size=128)
FAMILIES = list(SHAPES)


def family_config(family: str, tiny: bool):
    import transformers

    from rlhfkit.models.tiny import TINY_WINDOW

    shape = dict(SHAPES[family])
    if tiny:
        shape.update(TINY, max_position_embeddings=1024)
        for key, small in (("head_dim", 16), ("query_pre_attn_scalar", 16), ("num_experts", 8),
                           ("num_local_experts", 4), ("moe_intermediate_size", 32), ("sliding_window", TINY_WINDOW)):
            if key in shape:
                shape[key] = small
    cls = {"gemma3_text": transformers.Gemma3TextConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "gpt_oss": transformers.GptOssConfig, "phi3": transformers.Phi3Config,
           "olmo2": transformers.Olmo2Config, "olmo3": transformers.Olmo3Config}[family]
    return cls(**shape, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def params_of(config) -> int:
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def qwen2_twin(config):
    """A Qwen2 config with the family's width, depth, heads and vocabulary and its total size."""
    from transformers import Qwen2Config

    spec = ModelSpec.from_hf_config(config)
    h, layers = spec.hidden_size, spec.num_layers
    base = dict(vocab_size=spec.vocab_size, hidden_size=h, num_hidden_layers=layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_word_embeddings,
                rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    small = params_of(Qwen2Config(**base, intermediate_size=64))
    per_i = 3 * h * layers  # gate, up, down per unit of intermediate size
    inter = max(64, (params_of(config) - small) // per_i + 64)
    return Qwen2Config(**base, intermediate_size=int(inter // 64 * 64))


def build(config, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def _hf_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    x = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, x[0, 1:, None])[:, 0]
    return lp[start - 1:].cpu()


def parity(model, device: torch.device, dtype: torch.dtype, prompts: int = 8, new: int = 32) -> dict:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(10, vocab, (int(n),), generator=g).tolist() for n in torch.randint(8, 64, (prompts,),
                                                                                                generator=g)]
    engine = BuiltinEngine(model, None, device=device, dtype=dtype, eos_token_ids=[],
                           config=BuiltinEngineConfig(max_num_seqs=prompts, max_model_len=128))
    sp = SamplingParams(temperature=0.0, max_new_tokens=new)
    outs = engine.generate([GenerationRequest(p, sp, i) for i, p in enumerate(rows)])
    import copy

    same, first_diff, gaps, gaps32, hf_gaps32 = 0, [], [], [], []
    ref32 = copy.deepcopy(model).float()  # the same weights in fp32: what bf16 arithmetic approximates
    for p, (c,) in zip(rows, outs):
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0)[0, len(p):].tolist()
        diff = next((i for i, (a, b) in enumerate(zip(c.token_ids, ref)) if a != b), None)
        same += diff is None
        first_diff.append(diff)
        engine_lp, hf_lp = torch.tensor(c.logprobs), _hf_logprobs(model, p + c.token_ids, len(p))
        fp32_lp = _hf_logprobs(ref32, p + c.token_ids, len(p))
        gaps.append(float((engine_lp - hf_lp).abs().max()))
        gaps32.append(float((engine_lp - fp32_lp).abs().max()))
        hf_gaps32.append(float((hf_lp - fp32_lp).abs().max()))
    del ref32
    out = {"greedy_equal": f"{same}/{prompts}", "first_difference_at": first_diff,
           "logprob_max_abs_gap": max(gaps), "logprob_gap_per_prompt": [round(x, 5) for x in gaps],
           # both bf16 computations against the fp32 one on the engine's tokens: the engine's error
           # beside transformers' own bf16 error
           "engine_vs_fp32_max_gap": max(gaps32), "transformers_bf16_vs_fp32_max_gap": max(hf_gaps32),
           "engine_compiled": engine.runner.compiled, "engine_attention": engine.model.attn,
           "engine_compile_error": engine.runner.compile_error}
    engine.close()
    spec = ModelSpec.from_hf_config(model.config)
    if spec.moe is not None:
        out["routing_agreement"] = routing_agreement(model, spec, [p + c.token_ids for p, (c,) in zip(rows, outs)],
                                                     device, dtype)
    return out


def routing_agreement(model, spec: ModelSpec, seqs: list[list[int]], device: torch.device, dtype: torch.dtype) -> dict:
    """Share of (token, layer) positions whose engine top-k expert set equals transformers'."""
    engine = BuiltinEngine(model, None, device=device, dtype=dtype, eos_token_ids=[],
                           config=BuiltinEngineConfig(max_num_seqs=1, max_model_len=256, compile=False,
                                                      cuda_graphs=False))
    agree = total = 0
    for seq in seqs:
        with record_routing() as got:
            engine.generate([GenerationRequest(seq, SamplingParams(temperature=0.0, max_new_tokens=1), 0)])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq], device=device), output_router_logits=True).router_logits
        for layer_ids, lg in zip(got, logits):
            _, ref = route(lg, spec.moe)
            ref = ref[-layer_ids.shape[0]:]  # the engine's last layer: the last position only
            a, b = layer_ids.sort(-1).values, ref.sort(-1).values
            agree += int((a == b).all(-1).sum())
            total += a.shape[0]
    engine.close()
    return {"same_experts": agree / max(total, 1), "positions": total}


def throughput(config, device, dtype, args) -> dict:
    model = build(config, device, dtype)
    ids = prompts_for(args.batch, args.prompt, config.vocab_size)
    res = run_builtin(model, device, dtype, ids, args.new, args)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {k: res[k] for k in ("builtin_tok_s", "builtin_s", "builtin_warmup_s", "builtin_ms_per_step",
                                "builtin_compiled", "builtin_attention", "builtin_gemm", "builtin_profile") if k in res} | (
        {"builtin_compile_error": res["builtin_compile_error"]} if "builtin_compile_error" in res else {})


def run_family(family: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    config = family_config(family, args.tiny)
    twin = qwen2_twin(config)
    out: dict = {"family": family, "params": params_of(config), "qwen2_twin_params": params_of(twin),
                 "qwen2_twin_intermediate": twin.intermediate_size}
    t0 = time.time()
    if not args.skip_parity:
        model = build(config, device, dtype)
        try:
            out["parity"] = parity(model, device, dtype)
        except Exception as exc:  # noqa: BLE001 - the row reports it, the other families go on
            out["parity_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        out["family_throughput"] = throughput(config, device, dtype, args)
        out["qwen2_throughput"] = throughput(twin, device, dtype, args)
        out["ratio_vs_qwen2"] = out["qwen2_throughput"]["builtin_tok_s"] / out["family_throughput"]["builtin_tok_s"]
    except Exception as exc:  # noqa: BLE001
        out["throughput_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    out["seconds"] = round(time.time() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--skip_parity", action="store_true")
    p.add_argument("--profile", action="store_true", help="add each engine's decode-step and prefill kernels "
                                                          "(bench/harness/engine_run.py's profile_engine)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # harness/engine_run.py's run_builtin reads these engine settings: the defaults a user gets
    for key, value in dict(sync_every=16, sync_every_batch=64, max_prefill_tokens=16384, compile=False, cuda_graphs=True,
                           compile_prefill=True, fast_sampling=True, decode_attention="auto", compile_mode=None,
                           decode_gemm="auto", gemm_min_rows=64, lookahead_steps=None, trace=False).items():
        setattr(args, key, value)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows = []
    for family in args.families.split(","):
        row = {"gpu": gpu, "gpus": 1 if device.type == "cuda" else 0, "dtype": str(dtype).replace("torch.", ""),
               "batch": args.batch, "prompt": args.prompt, "new": args.new, **run_family(family, args, device, dtype)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    sync(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
