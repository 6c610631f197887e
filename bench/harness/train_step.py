"""Training-step builders of the benches: the shapes, the model, a plain HF step and rlhfkit's step
(`rlhfkit_step_fn` variants), step timing with optional GPU phase marks, and FLOPs / MFU figures
(train_throughput.py, profile_train_step.py, train_parallel.py, rl_step.py and the probes use them)."""

from __future__ import annotations

import os
import time

import torch

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
    from rlhfkit.backend.fsdp2 import FSDP2Backend
    from rlhfkit.config.configs import BackendConfig, OptimConfig
    from rlhfkit.parallel.dist import init_distributed
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
    """One more step under torch.profiler: phases sft/forward, sft/backward, sft/optimizer (bench/harness/step_profile.py);
    the Chrome trace is kept at `trace_path` when given."""
    from bench.harness.step_profile import profile_call

    return profile_call(step, prefix="sft/", top=top, trace_path=trace_path)


def format_summary(summary: dict) -> str:
    from bench.harness.step_profile import format_summary as fmt

    return fmt(summary)
