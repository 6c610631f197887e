"""Vision-language rollout throughput: the builtin engine vs HF `generate`, on picture + text prompts.

    python bench/rollout_vlm.py --shape qwen2.5-vl-7b --batch 64,256 --shapes 128x256 --out rollout_vlm_h200.json
    python bench/rollout_vlm.py --shape tiny --device cpu --batch 4 --shapes 16x16 --n 2   # CPU smoke test

The model is built from the shape's config with random weights (offline; `--shape qwen2.5-vl-7b` is
Qwen2.5-VL-7B-Instruct's config: a 28-layer 3584-wide language model and a 32-block vision tower).
Every prompt is one picture (`--picture` pixels square: (picture / 14)^2 patches, a quarter as many
picture tokens) followed by `prompt` random text tokens; the batch holds `batch / n` prompts of `n`
samples each, submitted as separate requests as the RL loop does (so the builtin engine's vision
tower runs once per picture and the n samples share it; HF `generate` encodes every row's picture).
Sampling at temperature 1 with eos ignored: every sequence runs `new` tokens; tokens/s counts new
tokens over wall time (prefill and the vision tower included), after a warm-up run. The builtin's
time is the median of `--repeat` generate() calls; HF's is one call.

Prints one JSON line: shape, device, picture tokens, and per (batch, shape) `builtin_tok_s`,
`hf_tok_s`, `speedup_vs_hf`, the builtin's vision-tower calls and pictures encoded per run. `--out`
is rewritten after every row (`"complete": false` until the last).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness.vlm_shapes import IDS, SHAPES  # noqa: E402
from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig  # noqa: E402
from rlhfkit.types import GenerationRequest, ImageInputs, SamplingParams  # noqa: E402

def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.for_model("qwen2_5_vl", **SHAPES[shape], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def requests(batch: int, n: int, plen: int, new: int, picture: int, vocab: int) -> tuple[list[GenerationRequest], int]:
    """`batch` requests (n per prompt, sharing its picture): [vision_start, picture run, vision_end, text...]."""
    side = picture // 14  # patches per side (merge 2: side must be even)
    grid = torch.tensor([[1, side, side]])
    tokens = side * side // 4
    g = torch.Generator().manual_seed(plen * 7919 + batch)
    reqs = []
    for p in range(batch // n):
        pixels = torch.randn(side * side, 3 * 2 * 14 * 14, generator=g)
        pics = ImageInputs(pixels, grid, [f"picture-{p}"])
        text = torch.randint(10, min(vocab, 150000), (plen,), generator=g).tolist()
        ids = [IDS["vision_start_token_id"]] + [IDS["image_token_id"]] * tokens + [IDS["vision_end_token_id"]] + text
        for s in range(n):
            reqs.append(GenerationRequest(ids, SamplingParams(temperature=1.0, max_new_tokens=new), p * n + s, pics))
    return reqs, tokens


def run_builtin(model, device, dtype, reqs, new: int, args) -> dict:
    cfg = BuiltinEngineConfig(max_num_seqs=len(reqs), max_model_len=len(reqs[0].prompt_token_ids) + new,
                              compile=bool(args.compile) and torch.device(device).type == "cuda",
                              cuda_graphs=None if args.cuda_graphs else False,
                              vision_cache_pictures=max(256, len(reqs)))
    engine = BuiltinEngine(model, None, device=device, dtype=dtype, config=cfg, eos_token_ids=[])
    t0 = time.perf_counter()
    engine.warmup(len(reqs))
    warm = [GenerationRequest(r.prompt_token_ids, r.params.replace(max_new_tokens=min(new, 16)), r.request_id,
                              ImageInputs(r.images.pixel_values, r.images.grid_thw, [f"warm-{k}" for k in r.images.keys]))
            for r in reqs]
    engine.generate(warm)
    sync(device)
    warm_s = time.perf_counter() - t0
    times, calls, pictures = [], [], []
    for i in range(max(1, args.repeat)):
        run = [GenerationRequest(r.prompt_token_ids, r.params, r.request_id,
                                 ImageInputs(r.images.pixel_values, r.images.grid_thw, [f"run{i}-{k}" for k in r.images.keys]))
               for r in reqs]  # fresh keys: every run encodes its pictures, as a new RL step does
        before = (engine.stats.vision_calls, engine.stats.pictures_encoded)
        t0 = time.perf_counter()
        outs = engine.generate(run)
        sync(device)
        times.append(time.perf_counter() - t0)
        calls.append(engine.stats.vision_calls - before[0])
        pictures.append(engine.stats.pictures_encoded - before[1])
        assert all(len(o[0].token_ids) == new for o in outs), "builtin: a sequence stopped early"
    dt = sorted(times)[len(times) // 2]
    res = {"builtin_tok_s": len(reqs) * new / dt, "builtin_s": dt, "builtin_runs_s": times, "builtin_warmup_s": warm_s,
           "builtin_vision_calls_per_run": calls[-1], "builtin_pictures_per_run": pictures[-1],
           "builtin_graphs": engine.runner.captures, "builtin_compiled": engine.runner.compiled}
    if engine.runner.compile_error:
        res["builtin_compile_error"] = engine.runner.compile_error
    engine.sleep(2)
    return res


def run_hf(model, device, reqs, new: int) -> dict:
    from rlhfkit.rollout.hf_engine import HFEngine

    engine = HFEngine(model, None, device=device, eos_token_ids=[], max_batch_size=len(reqs), pad_token_id=0)
    engine.generate([GenerationRequest(r.prompt_token_ids, r.params.replace(max_new_tokens=4), r.request_id, r.images)
                     for r in reqs])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    sync(device)
    dt = time.perf_counter() - t0
    assert all(len(o[0].token_ids) == new for o in outs), "hf: a sequence stopped early"
    return {"hf_tok_s": len(reqs) * new / dt, "hf_s": dt}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-vl-7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bf16 (CUDA default) or fp32 (CPU default)")
    p.add_argument("--batch", default="64,256", help="comma-separated sequences per run")
    p.add_argument("--shapes", default="128x256", help="comma-separated PROMPTxNEW text tokens")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (they share its picture)")
    p.add_argument("--picture", type=int, default=448, help="picture side in pixels (a multiple of 28)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--no_compile", dest="compile", action="store_false")
    p.add_argument("--no_cuda_graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--out", default=None, help="also write the JSON here (bench/results/ when a bare name)")
    args = p.parse_args(argv)
    if args.picture % 28:
        p.error("--picture must be a multiple of 28 (14-pixel patches, merged 2 x 2)")
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype] or (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(args.shape, device, dtype)
    vocab = model.config.text_config.vocab_size
    report: dict = {"bench": "rollout_vlm", "shape": args.shape, "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu", "dtype": str(dtype).replace("torch.", ""), "n": args.n,
                    "picture_px": args.picture, "complete": False, "rows": []}
    for batch in (int(b) for b in args.batch.split(",")):
        if batch % args.n:
            p.error(f"--batch {batch} must be a multiple of --n {args.n}")
        for sh in args.shapes.split(","):
            plen, new = (int(x) for x in sh.split("x"))
            reqs, tokens = requests(batch, args.n, plen, new, args.picture, vocab)
            row = {"batch": batch, "prompt_text": plen, "picture_tokens": tokens,
                   "prompt_tokens": len(reqs[0].prompt_token_ids), "new": new}
            row.update(run_builtin(model, device, dtype, reqs, new, args))
            if not args.skip_hf:
                row.update(run_hf(model, device, reqs, new))
                row["speedup_vs_hf"] = row["builtin_tok_s"] / row["hf_tok_s"]
            report["rows"].append(row)
            write(args.out, report)  # a run cut short keeps the rows that finished
    report["complete"] = True
    print(write(args.out, report))
    return report


def write(out: str | None, report: dict) -> str:
    """The report as one JSON line, also written to `out` (bench/results/ when a bare name)."""
    line = json.dumps(report)
    if out:
        path = out if os.sep in out else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", out)
        with open(path, "w") as f:
            f.write(line + "\n")
    return line


if __name__ == "__main__":
    main()
