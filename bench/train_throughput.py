"""Training-step throughput (tokens/s) and MFU for a model shape, against a plain baseline.

    python bench/train_throughput.py --model qwen2-0.5b --batch 8 --seq 2048 [--out bench/results/x.json]
    python bench/train_throughput.py --device cpu        # smoke run on the tiny shape

Measured in the same process, same data:
  baseline: plain HF model in bf16 + torch.optim.AdamW, full logits + cross-entropy (what a short
            hand-written loop does);
  rlhfkit:  the SFT task's loss (fused lm_head + log-prob kernel on GPU, no full-vocab logits
            kept) through the FSDP2 backend (bf16 module, fp32 master weights in a fused AdamW,
            grad clipping); other variants (--variants) in the same run.
MFU = 6 * N * tokens/s (+ attention flops) / peak bf16 flops of the GPU. One JSON line is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1_000_000.0),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=512, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=2048),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(name: str) -> float | None:
    for k, v in PEAK_BF16.items():
        if k in name:
            return v
    return None


def build(shape: str, device: str, dtype: torch.dtype, attn: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape])
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.to(dtype), cfg


def flops_per_token(cfg, n_params: int, seq: int, causal_half: bool = True, lora_params: int | None = None) -> float:
    """Training FLOPs a token, forward + backward, recomputation not counted: 6 N (2 N forward, 2 N for the
    activations' gradients, 2 N for the weights') + attention. The attention term 12 L h s counts the whole
    score matrix (QK^T and its product with V, forward and backward); by default it is halved here (a causal
    kernel skips the upper triangle), `causal_half=False` gives the whole count, which other stacks report.
    `lora_params` (adapters over a frozen base): the base needs no weight gradients, so 4 N + 6 x the adapters'
    parameters + attention."""
    attn = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
    dense = 6 * n_params if lora_params is None else 4 * n_params + 6 * lora_params
    return dense + (attn / 2 if causal_half else attn)


def lora_param_count(model, rank: int) -> int:
    """Parameters of rank-`rank` adapters on every linear layer of the decoder blocks (all-linear: the LM head
    left out), as a peft model would add them: rank x (in + out) each."""
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}.")


def phase_mfu(model_dir: str, tokens: float, seq: float, seconds: float | None, device_name: str,
              lora_rank: int = 0) -> float | None:
    """MFU of a phase that trains `tokens` tokens of rows `seq` long in `seconds` (same FLOPs count as above;
    the model's parameters counted on the meta device; `lora_rank`: adapters on every linear layer over a
    frozen base). None off the GPUs in PEAK_BF16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    peak = peak_flops(device_name)
    if not peak or not seconds:
        return None
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    lora = lora_param_count(model, lora_rank) if lora_rank else None
    return tokens * flops_per_token(cfg, active_params(model, cfg), int(seq), lora_params=lora) / seconds / peak


def active_params(model, cfg) -> int:
    """Parameters one token passes through: all, except that of a mixture of experts' expert weights
    (modules named `experts`) only the share top_k / num_experts counts."""
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    total = 0
    for name, p in model.named_parameters():
        routed = experts and top_k and ".experts." in f".{name}"
        total += p.numel() * top_k // experts if routed else p.numel()
    return total


HOST_S: list[float] = []  # host time of each timed step() call (the last time_steps call)
# (phase name, CUDA event) marks that an rlhfkit step() records while RECORD_PHASES is on (no sync)
RECORD_PHASES = False
PHASE_MARKS: list[tuple[str, "torch.cuda.Event"]] = []


def mark(name: str) -> None:
    if RECORD_PHASES:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        PHASE_MARKS.append((name, ev))


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of torch.cuda._sleep per millisecond, measured with events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)  # wake the clocks
    a.record()
    torch.cuda._sleep(50_000_000)
    b.record()
    b.synchronize()
    return 50_000_000 / a.elapsed_time(b)


def time_steps(step, n_warmup: int, n_steps: int, device: str, lead_ms: float = 0.0) -> float:
    """Seconds per step. With `lead_ms` (GPU only), each step starts behind a GPU sleep of about that length,
    so the host is ahead for the whole step and the GPU never waits for it; the seconds returned then include
    the sleep, whose length is only approximate (it counts clock cycles): read the GPU-only step from the
    phase marks (phase_times)."""
    cycles = int(lead_ms * sleep_cycles_per_ms()) if lead_ms and device == "cuda" else 0
    for _ in range(n_warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    HOST_S.clear()
    PHASE_MARKS.clear()
    t0 = time.perf_counter()
    for _ in range(n_steps):
        h = time.perf_counter()
        if cycles:
            mark("lead")
            torch.cuda._sleep(cycles)
        mark("forward")
        step()
        HOST_S.append(time.perf_counter() - h)
    mark("end")
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n_steps


def phase_times() -> dict[str, float]:
    """Mean GPU seconds between consecutive marks, by the name of the mark that opens the interval."""
    sums: dict[str, list[float]] = {}
    for (name, a), (_, b) in zip(PHASE_MARKS, PHASE_MARKS[1:]):
        sums.setdefault(name, []).append(a.elapsed_time(b) / 1e3)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def baseline_step_fn(model, ids, device, accum: int = 1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=(device == "cuda"))

    def step():
        for _ in range(accum):
            out = model(input_ids=ids, labels=ids)
            (out.loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


VARIANTS = ("master", "autocast", "fsdp1")  # each may take the suffixes _compile and _eagerloss


def rlhfkit_step_fn(model, ids, device, param_dtype: str, variant: str = "master", accum: int = 1):
    """One SFT step through FSDP2Backend. Variants (one process):
    master          bf16 module, fp32 master copies in a fused AdamW (the default)
    autocast        fp32 module under torch.autocast (--mixed_precision autocast)
    fsdp1           a one-rank process group: FSDP2 MixedPrecisionPolicy (what N ranks run)
    *_compile       the same with --torch_compile (each decoder block compiled)
    *_eagerloss     the fused log-prob head's row kernel in eager PyTorch instead of Triton
    *_recompute     the head's softmax gradient recomputed by chunks in backward even when it fits in memory
    *_cudnn, *_flash  SDPA restricted to cuDNN attention or to flash attention (experiments; torch picks
                    cuDNN on an H100 by default)
    *_cg            with _compile: the blocks compiled with mode="reduce-overhead" (CUDA graphs), an
                    experiment on launch overhead, not a flag.
    *_autotune      with _compile: mode="max-autotune-no-cudagraphs" (Triton GEMM templates with fused
                    epilogues tried against cuBLAS), an experiment.
    *_nofuse        q, k and v projected by three GEMMs instead of one (models/fused_qkv.py), for an A/B
    *_torchadam     torch's fused AdamW + a separate copy into the bf16 module instead of the one-pass
                    master-weight kernel (backend/master_adamw.py), for an A/B in one run."""
    from rlhfkit.parallel.dist import init_distributed
    from rlhfkit.backend.fsdp2 import FSDP2Backend
    from rlhfkit.config.configs import BackendConfig, OptimConfig
    from rlhfkit.trainers.sft_task import SFTTask

    from rlhfkit.models import fused_logprobs

    base, *suffixes = variant.split("_")
    if base not in VARIANTS or not set(suffixes) <= {"compile", "eagerloss", "cg", "autotune", "recompute", "cudnn",
                                                           "flash", "torchadam", "nofuse"}:
        raise ValueError(f"--variants: unknown variant {variant!r}; choose from {', '.join(VARIANTS)} "
                         "with optional suffixes _compile, _eagerloss")
    from rlhfkit.backend import master_adamw

    master_adamw.USE_KERNEL = "torchadam" not in suffixes
    from rlhfkit.models import fused_qkv

    fused_qkv.ENABLED = "nofuse" not in suffixes
    fused_logprobs.USE_TRITON = "eagerloss" not in suffixes
    fused_logprobs.KEEP_LOGITS_BYTES = 0 if "recompute" in suffixes else None
    if "cg" in suffixes or "autotune" in suffixes:
        from rlhfkit.parallel import apply as parallel_apply
        from rlhfkit.parallel.sharding import find_blocks

        mode = "reduce-overhead" if "cg" in suffixes else "max-autotune-no-cudagraphs"

        def compile_cg(model, dynamic=None):
            for block in find_blocks(model):
                block.compile(mode=mode, dynamic=dynamic)

        parallel_apply.compile_blocks = compile_cg
    if base == "fsdp1":
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist = init_distributed(device)
    cfg = BackendConfig(param_dtype=param_dtype, device=device, zero_stage=2,
                        mixed_precision="autocast" if base == "autocast" else "master_weights",
                        torch_compile="compile" in suffixes)
    backend = FSDP2Backend(model, cfg, OptimConfig(learning_rate=1e-5, lr_warmup_ratio=0.0),
                           num_training_steps=1000, dist=dist)
    task = SFTTask(pad_token_id=0, device=device)
    from rlhfkit.data.collate import PaddedBatch

    host = ids.cpu()  # collated on the host and moved, as the training loop does
    batch = PaddedBatch(input_ids=host, attention_mask=torch.ones_like(host), loss_mask=torch.ones_like(host)).to(device)
    count = float(ids.numel() * accum)

    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import record_function

    only = [b for k, b in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))
            if k in suffixes]

    def step():
        for _ in range(accum):
            with (sdpa_kernel(only) if only else nullcontext()), \
                    record_function("sft/forward"):
                loss, _ = task.loss(backend.model, batch, count)
            mark("backward")
            with record_function("sft/backward"):
                backend.backward(loss)
            mark("optimizer")
        with record_function("sft/optimizer"):
            backend.optimizer_step()

    return step


def gpu_sft_step(variant: str = "master_compile", shape: str = "qwen2-0.5b", batch: int = 8, seq: int = 2048):
    """The bench's rlhfkit step on the GPU (the probes under bench/probe/ time and trace it)."""
    model, _ = build(shape, "cuda", torch.float32, "sdpa")
    torch.manual_seed(0)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), device="cuda")
    return rlhfkit_step_fn(model, ids, "cuda", "bf16", variant)


def profile_step(step, top: int, trace_path: str | None = None):
    """One more step under torch.profiler: phases sft/forward, sft/backward, sft/optimizer (bench/step_profile.py);
    the Chrome trace is kept at `trace_path` when given."""
    from step_profile import profile_call

    return profile_call(step, prefix="sft/", top=top, trace_path=trace_path)


def format_summary(summary: dict) -> str:
    from step_profile import format_summary as fmt

    return fmt(summary)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches (of --batch x --seq) per optimizer step")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--skip_baseline", action="store_true")
    ap.add_argument("--variants", default="master", help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--gpu_lead_ms", type=float, default=0.0,
                    help="also time each rlhfkit variant behind a GPU sleep of this many ms per step (the host "
                         "then never starves the GPU) and report the GPU-only step time and phase split")
    ap.add_argument("--trace", action="store_true", help="with --profile: keep each profiled step's Chrome trace")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="after timing, profile one step of each rlhfkit variant (phases forward / backward / "
                         "optimizer, GPU idle, kernels by class) into PATH.json")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    shape = a.model or ("qwen2-0.5b" if gpu else "tiny")
    batch, seq = a.batch or (8 if gpu else 4), a.seq or (2048 if gpu else 128)
    steps = a.steps or (10 if gpu else 3)
    torch.manual_seed(0)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), device=a.device)
    tokens = batch * seq * a.accum
    name = torch.cuda.get_device_name() if gpu else "cpu"
    res: dict = {"bench": "train_throughput", "device": name, "model": shape, "batch": batch, "seq": seq,
                 "accum": a.accum}
    if not a.skip_baseline:
        model, cfg = build(shape, a.device, torch.bfloat16 if gpu else torch.float32, a.attn)
        n_params = sum(p.numel() for p in model.parameters())
        t = time_steps(baseline_step_fn(model, ids, a.device, a.accum), 2, steps, a.device)
        res["baseline_tokens_per_s"] = tokens / t
        res["baseline_step_s"] = t
        if gpu:
            res["baseline_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        del model
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    profiles: dict = {}
    for variant in a.variants.split(","):
        if gpu:
            torch.cuda.reset_peak_memory_stats()  # the previous variant's profiled step is not this one's peak
        model, cfg = build(shape, a.device, torch.float32, a.attn)
        n_params = sum(p.numel() for p in model.parameters())
        key = "rlhfkit" if variant == a.variants.split(",")[0] else f"rlhfkit_{variant}"
        try:
            step = rlhfkit_step_fn(model, ids, a.device, "bf16" if gpu else "fp32", variant, a.accum)
            t = time_steps(step, 3, steps, a.device)
        except Exception as e:  # noqa: BLE001 - a failing variant is recorded, the others still run
            res[f"{key}_error"] = f"{type(e).__name__}: {e}"[:500]
            del model
            if gpu:
                torch.cuda.empty_cache()
            continue
        res.update({"n_params": n_params, f"{key}_tokens_per_s": tokens / t, f"{key}_step_s": t,
                    f"{key}_host_step_s": sorted(HOST_S)[len(HOST_S) // 2]})
        if gpu:
            res[f"{key}_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        if gpu and a.gpu_lead_ms:
            # the same step twice more with phase marks: as timed above, then behind a GPU sleep, whose step
            # time is the GPU's work alone; the difference is the time the GPU waited for the host
            global RECORD_PHASES
            RECORD_PHASES = True
            res[f"{key}_marked_step_s"] = time_steps(step, 1, steps, a.device)
            res[f"{key}_phases_s"] = phase_times()
            time_steps(step, 1, steps, a.device, lead_ms=a.gpu_lead_ms)
            res[f"{key}_gpu_phases_s"] = {k: v for k, v in phase_times().items() if k != "lead"}
            res[f"{key}_gpu_step_s"] = sum(res[f"{key}_gpu_phases_s"].values())
            RECORD_PHASES = False
        if a.profile:
            profiles[key] = profile_step(step, top=20, trace_path=f"{a.profile}_{key}.trace.json" if a.trace else None)
            print(f"[{key}]\n" + format_summary(profiles[key]), flush=True)
        fpt = flops_per_token(cfg, n_params, seq)
        peak = peak_flops(name)
        palm = flops_per_token(cfg, n_params, seq, causal_half=False)
        if peak:
            res[f"{key}_mfu"] = res[f"{key}_tokens_per_s"] * fpt / peak
            res[f"{key}_mfu_palm"] = res[f"{key}_tokens_per_s"] * palm / peak
            if "baseline_tokens_per_s" in res:
                res["baseline_mfu"] = res["baseline_tokens_per_s"] * fpt / peak
                res["baseline_mfu_palm"] = res["baseline_tokens_per_s"] * palm / peak
        del model, step
        if gpu:
            torch.cuda.empty_cache()
    res["variants"] = a.variants
    from rlhfkit.models import fused_logprobs

    res["head_grad_fp32_gemm"] = fused_logprobs._OUT_DTYPE_MM and gpu  # fp32-output GEMM for lm_head's grad
    if "baseline_tokens_per_s" in res:
        res["speedup_vs_baseline"] = res["rlhfkit_tokens_per_s"] / res["baseline_tokens_per_s"]
    print(json.dumps(res))
    if a.profile:
        os.makedirs(os.path.dirname(a.profile) or ".", exist_ok=True)
        with open(a.profile + ".json", "w") as f:
            json.dump({"device": name, "model": shape, "batch": batch, "seq": seq, "profiles": profiles}, f, indent=1)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
