"""Issue 17's multi-GPU training figures: SFT throughput under a training mesh, and the longest sequence that trains.

    torchrun --nproc_per_node 4 bench/train_parallel.py --mode throughput --model qwen2.5-7b \\
        --ds_tensor_parallel_size 2 --batch 8 --seq 4096 --out bench/results/train_parallel_7b_tp2_h100x4.json
    torchrun --nproc_per_node 4 bench/train_parallel.py --mode longest --model qwen2-0.5b --ring_attn_size 2 \\
        --lengths 8192:262144 --out bench/results/train_parallel_longest_05b_ring2_h100x4.json
    torchrun --nproc_per_node 2 bench/train_parallel.py --device cpu --model tiny --ds_tensor_parallel_size 2 ...

bench/run_parallel_gpu.sh holds the exact runs of the issue. Every rank builds the mesh from the flags as
the CLIs do (`ParallelDims.from_flags(world, --zero_stage, --ds_tensor_parallel_size, --ring_attn_size)`,
`attach_mesh`), loads the model (`--model tiny`: built in-process from harness/train_step.py's tiny shape,
vocabulary 512 so tp 2 divides it; other shapes: harness/models.py's random-weight directory under
--model_dir, written by local rank 0 when missing) and trains it through `FSDP2Backend` with the SFT
task's loss (fused / vocabulary-parallel log-probs, fp32 master weights, AdamW, clipping), as
train_throughput.py drives one process. A mesh the backend refuses (e.g. --ring_attn_size > 1 before
context parallelism exists) is not a crash: the JSON gets "error" with the message, and the exit code is 0.

Modes:
  throughput  --batch rows of --seq random tokens per step, *global* (cut over the dp ranks; the tp and
              cp ranks of one dp rank see the same rows), --warmup then --steps timed steps. Reports
              step_s, tokens_per_s (all GPUs), tokens_per_s_per_gpu, mfu (6 N + attention flops per
              token, harness/train_step.py's convention, per GPU against its peak bf16; recomputation under
              gradient checkpointing is not counted), peak_mem_gb of every rank, and loss_by_rank: every
              rank's view of each step's global loss (summed over the loss group), which must be the same
              on every rank and, for the same --batch / --seq / --seed, under every mesh.
  longest     for each length of --lengths (a list, or LO:HI doubling), one row of that length per dp
              rank, --long_steps fwd+bwd+optimizer steps (the last timed); stops at the first length
              that runs out of GPU memory (torch.OutOfMemoryError: every rank catches it at the same
              op, as the shapes are the same on every rank; the ranks then agree with an all-reduce, free
              the gradients and cached blocks, and stop; a rank out of memory alone would leave its peers
              waiting in a collective, so the driver puts a `timeout` on every run). Reports each length
              tried and longest_seq with its tokens/s per GPU, step time and peak memory. The JSON is
              rewritten after every length, so a run cut short keeps what it measured ("complete":
              false). --time_budget_s stops before a length predicted to overrun it (stop_reason says
              why the run stopped). --fake_oom_above N raises the error for lengths above N (how the CPU
              test exercises the stop).

Memory: peak_mem_gb is torch.cuda.max_memory_allocated per rank (reset per length in `longest`); on CPU the
process's maximum resident set (mem_kind says which). Rank 0 prints one JSON line and writes --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as tdist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: rlhfkit, bench.harness

from bench.harness.models import SHAPES as DISK_SHAPES
from bench.harness.models import make_bench_model
from bench.harness.train_step import SHAPES as INPROC_SHAPES
from bench.harness.train_step import flops_per_token, peak_flops

MODELS = ("tiny", "qwen2-0.5b", "qwen2.5-7b", "qwen2.5-32b")


def parse_lengths(text: str) -> list[int]:
    """"4096,8192" or "4096:65536" (doubling from LO up to HI)."""
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":"))
            if lo < 1 or hi < lo:
                raise ValueError
            out = [lo]
            while out[-1] * 2 <= hi:
                out.append(out[-1] * 2)
            return out
        out = [int(x) for x in text.split(",") if x.strip()]
        if not out or min(out) < 2:
            raise ValueError
        return out
    except ValueError:
        raise SystemExit(f"error: --lengths {text!r}: give a comma list of lengths >= 2 or LO:HI") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("throughput", "longest"), default="throughput")
    ap.add_argument("--model", choices=MODELS, default=None, help="default: qwen2-0.5b on cuda, tiny on cpu")
    ap.add_argument("--model_dir", default=None, help="the random-weight model directory (default /tmp/bench_MODEL)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ds_tensor_parallel_size", type=int, default=1)
    ap.add_argument("--ring_attn_size", type=int, default=1)
    ap.add_argument("--ring_head_stride", type=int, default=1)
    ap.add_argument("--zero_stage", type=int, default=3)
    ap.add_argument("--gradient_checkpointing", choices=("on", "off"), default="on")
    ap.add_argument("--attn", default="sdpa", help="attention implementation of the model (ring attention replaces it)")
    ap.add_argument("--param_dtype", default=None, help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--batch", type=int, default=None, help="throughput: global rows per step (default: dp size)")
    ap.add_argument("--seq", type=int, default=None, help="throughput: tokens per row (default 4096 cuda, 32 cpu)")
    ap.add_argument("--steps", type=int, default=None, help="throughput: timed steps (default 5 cuda, 2 cpu)")
    ap.add_argument("--warmup", type=int, default=None, help="throughput: untimed steps first (default 2 cuda, 1 cpu)")
    ap.add_argument("--lengths", default=None, help="longest: comma list or LO:HI doubling (default 4096:262144)")
    ap.add_argument("--long_steps", type=int, default=2, help="longest: steps per length, the last one timed")
    ap.add_argument("--time_budget_s", type=float, default=None,
                    help="longest: skip a length whose predicted time (last step x length ratio squared) would "
                         "pass this many seconds since the first length started")
    ap.add_argument("--fake_oom_above", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda")
    a.model = a.model or ("qwen2-0.5b" if gpu else "tiny")
    a.param_dtype = a.param_dtype or ("bf16" if gpu else "fp32")
    a.seq = a.seq or (4096 if gpu else 32)
    a.steps = a.steps if a.steps is not None else (5 if gpu else 2)
    a.warmup = a.warmup if a.warmup is not None else (2 if gpu else 1)
    a.lengths = parse_lengths(a.lengths or ("4096:262144" if gpu else "16:64"))
    return a


# ----------------------------------------------------------------------------- setup


def load_model(a: argparse.Namespace, dist: Any) -> torch.nn.Module:
    """The fp32 model on the host, the same weights on every rank."""
    from rlhfkit.config.configs import ModelConfig
    from rlhfkit.models.loader import load_causal_lm

    if a.model == "tiny":
        from transformers import AutoModelForCausalLM, Qwen2Config

        cfg = Qwen2Config(**INPROC_SHAPES["tiny"])
        torch.manual_seed(a.seed)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=a.attn, dtype=torch.float32)
    if a.model not in DISK_SHAPES:
        raise SystemExit(f"error: --model {a.model}: not one of harness/models.py's shapes {DISK_SHAPES}")
    path = a.model_dir or f"/tmp/bench_{a.model}"
    if dist.local_rank == 0:
        make_bench_model(path, a.model, device=a.device if a.device.startswith("cuda") else None, seed=a.seed)
    if tdist.is_initialized():
        tdist.barrier()
    return load_causal_lm(ModelConfig(pretrain=path, param_dtype=a.param_dtype, attn_implementation=a.attn),
                          master_dtype="fp32", defer_weights=True)


def build(a: argparse.Namespace) -> tuple[Any, Any, Any, dict]:
    """(dist, dims, backend, facts); raises ValueError for a mesh or model the backend refuses."""
    from dataclasses import fields

    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.config.configs import BackendConfig, OptimConfig
    from rlhfkit.parallel import init_distributed
    from rlhfkit.parallel.mesh import ParallelDims, attach_mesh

    dist = init_distributed(a.device)
    dims = ParallelDims.from_flags(dist.world_size, a.zero_stage, tensor_parallel_size=a.ds_tensor_parallel_size,
                                   ring_attn_size=a.ring_attn_size)
    dims.check_supported()  # a dimension no backend implements: refused before loading the model
    dist = attach_mesh(dist, dims)
    model = load_model(a, dist)
    facts = {"n_params": sum(p.numel() for p in model.parameters()), "config": model.config}
    kw: dict[str, Any] = {"param_dtype": a.param_dtype, "device": dist.device, "zero_stage": a.zero_stage,
                          "gradient_checkpointing": a.gradient_checkpointing == "on"}
    if "ring_head_stride" in {f.name for f in fields(BackendConfig)}:  # with context parallelism
        kw["ring_head_stride"] = a.ring_head_stride
    backend = FSDP2Backend(model, BackendConfig(**kw), OptimConfig(learning_rate=1e-5, lr_warmup_ratio=0.0),
                           num_training_steps=10_000, dist=dist, parallel=dims)
    return dist, dims, backend, facts


def local_batch(vocab: int, rows: int, seq: int, dist: Any, seed: int) -> tuple[Any, float]:
    """This dp rank's share of `rows` global rows of `seq` random ids (no padding: attention_mask None),
    and the global count of loss tokens (every token but each row's first)."""
    from rlhfkit.data.collate import PaddedBatch

    if rows % dist.dp_size:
        raise SystemExit(f"error: --batch {rows} is not divisible by the data-parallel size {dist.dp_size}")
    per = rows // dist.dp_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)[dist.dp_rank * per:(dist.dp_rank + 1) * per]
    mask = torch.ones_like(ids)
    mask[:, 0] = 0
    dev = torch.device(dist.device)
    return PaddedBatch(input_ids=ids.to(dev), attention_mask=None, loss_mask=mask.to(dev)), float(rows * (seq - 1))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order (one process: [obj])."""
    if not tdist.is_initialized():
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def write(res: dict, out: str | None, rank: int, final: bool = True) -> None:
    if rank != 0:
        return
    if final:
        print(json.dumps(res), flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=2)
        os.replace(tmp, out)


# ----------------------------------------------------------------------------- modes


def mfu(res: dict, facts: dict, seq: int, tokens_per_s_per_gpu: float) -> float | None:
    peak = peak_flops(res["device"])
    return tokens_per_s_per_gpu * flops_per_token(facts["config"], facts["n_params"], seq) / peak if peak else None


def run_throughput(a: argparse.Namespace, dist: Any, backend: Any, facts: dict, res: dict) -> None:
    from rlhfkit.trainers.sft_task import SFTTask

    rows = a.batch or dist.dp_size
    batch, count = local_batch(facts["config"].vocab_size, rows, a.seq, dist, a.seed)
    task = SFTTask(pad_token_id=0, device=dist.device, dist=dist)
    losses: list[float] = []

    def step() -> None:
        loss, _ = task.loss(backend.model, batch, count)
        backend.backward(loss)
        backend.optimizer_step()
        losses.append(float(loss.detach()))

    for _ in range(a.warmup):
        step()
    sync(dist.device)
    if dist.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync(dist.device)
    step_s = (time.perf_counter() - t0) / max(a.steps, 1)
    per_step = dist.all_reduce_loss(torch.tensor(losses, dtype=torch.float64, device=dist.device))
    tokens = rows * a.seq
    per_gpu = tokens / step_s / dist.world_size
    res.update(batch=rows, rows_per_dp_rank=rows // dist.dp_size, seq=a.seq, warmup=a.warmup, steps=a.steps,
               step_s=step_s, tokens_per_s=tokens / step_s, tokens_per_s_per_gpu=per_gpu,
               mfu=mfu(res, facts, a.seq, per_gpu), peak_mem_gb=gather(peak_gb(dist.device)),
               loss_by_rank=gather(per_step.cpu().tolist()))
    res["peak_mem_gb_max"] = max(res["peak_mem_gb"])


def _oom_everywhere(hit: bool, dist: Any) -> bool:
    """Whether any rank ran out of memory (every rank must call this after each attempt)."""
    flag = torch.tensor([1.0 if hit else 0.0], device=dist.device)
    return bool(dist.all_reduce_world(flag, op="max").item() > 0)


def _long_steps(a: argparse.Namespace, task: Any, backend: Any, vocab: int, seq: int, dist: Any) -> float:
    """--long_steps steps on one row of `seq` tokens per dp rank; the last step's seconds. Every tensor
    of the steps lives in this frame, so an exception raised here frees them as it leaves."""
    batch, count = local_batch(vocab, dist.dp_size, seq, dist, a.seed + seq)
    step_s = 0.0
    for _ in range(a.long_steps):
        sync(dist.device)
        t0 = time.perf_counter()
        loss, _ = task.loss(backend.model, batch, count)
        if a.fake_oom_above is not None and seq > a.fake_oom_above:
            raise torch.OutOfMemoryError(f"fake out of memory at {seq} tokens (--fake_oom_above)")
        backend.backward(loss)
        backend.optimizer_step()
        del loss
        sync(dist.device)
        step_s = time.perf_counter() - t0
    return step_s


def run_longest(a: argparse.Namespace, dist: Any, backend: Any, facts: dict, res: dict) -> None:
    from rlhfkit.trainers.sft_task import SFTTask

    task = SFTTask(pad_token_id=0, device=dist.device, dist=dist)
    res.update(long_steps=a.long_steps, lengths=a.lengths, tried=[], longest_seq=None, complete=False)
    cuda = dist.device.startswith("cuda")
    start, prev = time.perf_counter(), None
    for seq in a.lengths:
        if a.time_budget_s is not None and prev is not None:
            guess = prev[1] * (seq / prev[0]) ** 2 * a.long_steps  # attention grows with the square
            late = time.perf_counter() - start + guess > a.time_budget_s
            if dist.all_reduce_world(torch.tensor([float(late)], device=dist.device), op="max").item() > 0:
                res.update(stopped_at=seq, stop_reason=f"--time_budget_s {a.time_budget_s:g}: about {guess:.0f} s "
                                                       "more predicted")
                break
        entry: dict[str, Any] = {"seq": seq, "ok": False}
        hit, err = False, None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            entry["step_s"] = _long_steps(a, task, backend, facts["config"].vocab_size, seq, dist)
        except RuntimeError as e:  # torch.OutOfMemoryError, or the same raised through a collective
            if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
                raise
            hit, err = True, (str(e).splitlines() or [type(e).__name__])[0][:300]
        if hit:  # free what the failed step left: gradients, cached blocks
            opt = getattr(backend, "optimizer", None)
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        any_oom = _oom_everywhere(hit, dist)
        entry["peak_mem_gb"] = gather(peak_gb(dist.device))
        if any_oom:
            entry["error"] = err or "another rank ran out of memory"
            entry["oom_ranks"] = [r for r, h in enumerate(gather(hit)) if h]
            res["tried"].append(entry)
            res.update(stopped_at=seq, stop_reason="out of memory")
            break
        per_gpu = dist.dp_size * seq / entry["step_s"] / dist.world_size
        entry.update(ok=True, tokens_per_s_per_gpu=per_gpu, mfu=mfu(res, facts, seq, per_gpu),
                     peak_mem_gb_max=max(entry["peak_mem_gb"]))
        res["tried"].append(entry)
        res.update(longest_seq=seq, longest_step_s=entry["step_s"], longest_tokens_per_s_per_gpu=per_gpu,
                   longest_mfu=entry["mfu"], longest_peak_mem_gb=entry["peak_mem_gb_max"])
        write(res, a.out, dist.rank, final=False)
        prev = (seq, entry["step_s"])
    res["complete"] = True


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    gpu = a.device.startswith("cuda")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    res: dict[str, Any] = {
        "bench": "train_parallel", "mode": a.mode,
        "device": torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", "0"))) if gpu else "cpu",
        "gpu_count": world if gpu else 0, "gpus_on_host": torch.cuda.device_count() if gpu else 0,
        "world_size": world, "model": a.model,
        "ds_tensor_parallel_size": a.ds_tensor_parallel_size, "ring_attn_size": a.ring_attn_size,
        "ring_head_stride": a.ring_head_stride, "zero_stage": a.zero_stage, "param_dtype": a.param_dtype,
        "gradient_checkpointing": a.gradient_checkpointing, "attn": a.attn, "seed": a.seed,
        "mem_kind": "cuda_max_allocated" if gpu else "host_max_rss", "error": None}
    try:
        dist, dims, backend, facts = build(a)
    except ValueError as e:  # a mesh / model the backend refuses: the same on every rank
        res["error"] = f"{type(e).__name__}: {e}"
        write(res, a.out, rank)
        if tdist.is_initialized():
            tdist.destroy_process_group()
        return
    res.update(dp=dims.dp, n_params=facts["n_params"], torch=torch.__version__,
               model_training=backend.model.training)  # HF checkpoints activations only in training mode
    if a.mode == "throughput":
        run_throughput(a, dist, backend, facts, res)
    else:
        run_longest(a, dist, backend, facts, res)
    write(res, a.out, dist.rank)
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
