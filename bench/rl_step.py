"""Time per RL (GRPO) step and its split by phase: rlhfkit's loop next to TRL's GRPOTrainer.

    python bench/rl_step.py --model qwen2-0.5b --prompts 64 --n 8 --new_tokens 256 --trl_prompts 8 64 \
        --out bench/results/rl_step_h100.json
    python bench/rl_step.py --model tiny --prompts 8 --n 4 --prompt_len 32 --new_tokens 16 --steps 2 --device cpu

Both sides run in the same process on the same random-init model directory (harness/models.py),
the same prompts (random letters, `--prompt_len` tokens each, no chat template), the same reward
(fraction of digit characters in the completion) and the same batch: `prompts x n` completions
of exactly `--new_tokens` tokens (eos is banned until the limit: rlhfkit's
`SamplingParams.min_new_tokens`, TRL's `generation_kwargs={"min_new_tokens": ...}`), GRPO
advantages, no KL term / reference model, one optimizer step per RL step, bf16 compute with
fp32 master weights, gradient checkpointing on GPU.

rlhfkit: `rlhfkit.cli.train_ppo`'s own flag parsing, checks and `rl_run.local.local_trainer`; one
`trainer.train_step()` per RL step. Phases come from the loop's metrics (time/generate includes
the reward_func calls, which run inside the agent episodes; time/reward is the reward-model pass).
Bench-only changes, both recorded in the JSON: the engine's batch (`--max_num_seqs`, default all
completions of a step, the CLI has no flag for it yet) and min_new_tokens = max_new_tokens.

TRL: `GRPOTrainer` with `per_device_train_batch_size` = the micro batch and
`gradient_accumulation_steps` = completions / micro batch, so one generation of all completions
and one optimizer step per trainer step (steps_per_generation defaults to the accumulation). The
step time is the wall time between consecutive `on_step_end` callbacks; its generation time is
measured around `_generate_single_turn` (HF `generate`). TRL is imported lazily.

With one optimizer step per generation both sides take the old log-probs from the training pass (no
separate pass; rlhfkit's `--recompute_old_logprobs` brings it back). `train_mfu`: the training phase's MFU.

The first step of every run is a warm-up (CUDA graphs, compilation) and is not timed; `step_s` is
the mean over the timed steps (`step_s_median` beside it). With `--trl_prompts` smaller than
`--prompts` (TRL too slow or too big for the full batch), rlhfkit also runs at each TRL batch and
`speedup_vs_trl` compares the two at the same batch. One JSON line is printed; with `--out` the
file is rewritten after every run, so a run cut short keeps what finished (`"complete": false`).

`--ray_layout disaggregated|colocated|colocated_nosleep` runs train_ppo_ray's trainer on Ray actors instead (and no
TRL): step time, phases and weight-sync time / MB / path per layout; see harness/ray_step.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness

from bench.harness.models import (SHAPES, device_name, free_memory, make_bench_model, peak_gib,  # noqa: E402
                                  random_prompt)
from bench.harness.ray_step import RAY_HEADLINE, add_ray_args, run_ray  # noqa: E402
from bench.harness.report import package_version, write_report  # noqa: E402
from bench.harness.rl_run import (engine_batch, engine_batch_size, force_full_length, rlhfkit_argv,  # noqa: E402
                                  summarize_rlhfkit, write_inputs)
from bench.harness.timing import median, sync  # noqa: E402
from bench.harness.train_step import phase_mfu  # noqa: E402
from bench.harness.trl_step import run_trl  # noqa: E402

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
               ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_DISABLED", "true")):
    os.environ.setdefault(_k, _v)


# ----------------------------------------------------------------------------- rlhfkit


class MemoryWatch:
    """Peaks over a run: the device's used memory as the driver reports it (cudaMemGetInfo, the figure NVML
    gives; sampled every 20 ms on a thread) and this process's resident host memory (VmHWM)."""

    def __init__(self, device: str) -> None:
        import threading

        from rlhfkit.utils.host_memory import reset_peak

        self.cuda = device.startswith("cuda")
        self.peak_used = 0
        self._stop = threading.Event()
        reset_peak()
        self._thread = threading.Thread(target=self._poll, daemon=True) if self.cuda else None
        if self._thread is not None:
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            free, total = torch.cuda.mem_get_info()
            self.peak_used = max(self.peak_used, total - free)

    def result(self) -> dict:
        from rlhfkit.utils.host_memory import status_bytes

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        out = {"host_peak_rss_gib": round(status_bytes("VmHWM") / 2**30, 2)}
        if self.cuda:
            out["device_used_peak_gib"] = round(self.peak_used / 2**30, 2)
        return out


def run_rlhfkit(a: argparse.Namespace, model_dir: str, data: str, reward: str, work: str, prompts: int) -> dict:
    """Build train_ppo's trainer from its flags; 1 warm-up + `a.steps` timed `train_step()` calls."""
    from rlhfkit.cli.common import set_seed
    from rlhfkit.cli.train_ppo import build_parser
    from rlhfkit.rl_run.local import local_trainer
    from rlhfkit.rl_run.resolve import resolve
    from rlhfkit.parallel.dist import init_distributed

    parsed = build_parser().parse(rlhfkit_argv(a, model_dir, data, reward, work, prompts))
    watch = MemoryWatch(a.device)
    dist = init_distributed(parsed.device)
    args = resolve(parsed, dist.world_size)
    set_seed(args.seed)
    with engine_batch(a.max_num_seqs or prompts * a.n):
        trainer, placement = local_trainer(args, dist)
    engine = placement.engine
    try:
        min_new = force_full_length(trainer)
        walls, metrics = time_steps(trainer, a.steps, a.device, a.warmup_steps)
        prof = profile_step(trainer, a, prompts) if a.profile else None
    finally:  # an engine left open keeps its worker thread, weights and KV cache alive
        close = getattr(engine, "close", None)
        if callable(close):
            close()
        trainer.logger.close()
    out = summarize_rlhfkit(walls, metrics, prompts * a.n)
    out.update(watch.result())
    out["plan_peak_gib"] = plan_peak_gib(args)
    seq = a.prompt_len + (out["response_length"] or 0)  # the training phase's MFU (median step)
    out["train_mfu"] = phase_mfu(model_dir, prompts * a.n * seq, seq, median([m["time/train"] for m in metrics]),
                                 device_name(a.device), lora_rank=args.lora_rank)
    out.update(prompts=prompts, completions=prompts * a.n, peak_gpu_gib=peak_gib(a.device), min_new_tokens=min_new,
               micro_train_batch_size=args.micro_train_batch_size,
               micro_rollout_batch_size=args.micro_rollout_batch_size,
               engine_max_num_seqs=engine_batch_size(engine), rlhfkit_flags=a.rlhfkit_flags,
               engine_stats=dict(vars(engine.stats)) if hasattr(engine, "stats") else None)
    return out if prof is None else {**out, "profile": prof}


def plan_peak_gib(args: argparse.Namespace) -> float | None:
    """The peak train_ppo's memory plan (printed before loading, on a GPU) gives this run, for the JSON
    beside the device's measured peak."""
    from rlhfkit.rl_run import builders
    from rlhfkit.rl_run.memory_check import memory_inputs
    from rlhfkit.distributed.memory_plan import plan_memory

    try:
        inputs = memory_inputs(args, {r: 1 for r in builders.roles_in_run(args)}, local=True)
    except Exception:  # noqa: BLE001 - the plan is skipped where the CLI skips it
        return None
    return round(plan_memory(inputs).peak / 2**30, 2)


def python_profile(fn: Callable[[], Any], rows: int) -> list[str]:
    """cProfile of `fn()` on this thread (the agent episodes; the engine's worker thread is not seen):
    the `rows` functions with the most own time, as pstats prints them."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    head = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    table = [ln[:200] for ln in lines[head:head + rows + 1]]
    buf = io.StringIO()  # and by cumulative time, with who waited on the GPU (`.cpu()`)
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(rows)
    stats.print_callers("method 'cpu'")
    more = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    head = next((i for i, ln in enumerate(more) if "ncalls" in ln), 0)
    table += ["-- by cumulative time --"] + [ln[:200] for ln in more[head:]]
    print("[rl_step] python profile of one rollout:\n" + "\n".join(table), file=sys.stderr, flush=True)
    return table


def profile_step(trainer: Any, a: argparse.Namespace, prompts: int) -> dict:
    """One more step under torch.profiler: phases, GPU busy / idle, kernels by class (harness/step_profile.py);
    the table goes to stderr, the summary into the run's record and `<--profile>_<prompts>.json`."""
    from bench.harness.step_profile import format_summary, profile_call

    def one() -> None:
        trainer.train_step()
        trainer.state.step += 1

    trace = f"{a.profile}_{prompts}_trace.json" if a.profile_trace else None
    summary = profile_call(one, prefix="rl/", trace_path=trace)
    summary["python_rollout"] = python_profile(lambda: trainer.rollout(), 25)
    print(f"[rl_step] profile of one step, {prompts} prompts x {a.n}:\n{format_summary(summary)}",
          file=sys.stderr, flush=True)
    with open(f"{a.profile}_{prompts}.json", "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _counters(device: str) -> dict[str, float]:
    """Process-wide counters whose change over a step explains a slow one: torch.compile graph
    compilations, the CUDA caching allocator's retries (a full free-and-retry of cached blocks) and its
    cudaMalloc / cudaFree calls (each cudaFree waits for the device)."""
    from torch._dynamo.utils import counters

    out = {"compiles": float(sum(counters["stats"].values()) and counters["stats"].get("unique_graphs", 0))}
    if device.startswith("cuda"):
        stats = torch.cuda.memory_stats()
        out["alloc_retries"] = float(stats.get("num_alloc_retries", 0))
        out["device_allocs"] = float(stats.get("num_device_alloc", 0))
        out["device_frees"] = float(stats.get("num_device_free", 0))
    return out


def time_steps(trainer: Any, steps: int, device: str, warmup: int = 1) -> tuple[list[float], list[dict]]:
    """`warmup` untimed + `steps` timed `train_step()` calls (as `fit` runs them) -> wall times, metrics
    (each with `gc_s`: the seconds Python's garbage collector ran during the step)."""
    walls: list[float] = []
    metrics: list[dict] = []
    gc_time = [0.0, 0.0]  # total, start of the current collection

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time[1] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[1]

    gc.callbacks.append(on_gc)
    try:
        for i in range(warmup + steps):
            sync(device)
            g0, c0 = gc_time[0], _counters(device)
            t0 = time.perf_counter()
            m = trainer.train_step()
            trainer.state.step += 1
            sync(device)
            if i >= warmup:
                walls.append(time.perf_counter() - t0)
                c1 = _counters(device)
                metrics.append(dict(m, gc_s=gc_time[0] - g0, **{k: c1[k] - c0[k] for k in c1}))
    finally:
        gc.callbacks.remove(on_gc)
    return walls, metrics


# ----------------------------------------------------------------------------- driver

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, choices=SHAPES, help="default: qwen2-0.5b on cuda, tiny on cpu")
    ap.add_argument("--model_dir", default=None, help="where the random model is written (reused if present)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per RL step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt_len", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--new_tokens", type=int, default=256, help="tokens per completion (all run to the limit)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup_steps", type=int, default=1,
                    help="untimed steps first (CUDA graphs, compilation; with --torch_compile the varying "
                         "sequence lengths of the first steps also recompile the blocks once as dynamic)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rollout_engine", default="builtin", choices=["builtin", "hf"])
    ap.add_argument("--disk_dtype", default="bf16", choices=["bf16", "fp8"],
                    help="the random model's safetensors (fp8: half the disk, e.g. the 32B shape on a 64 GiB disk; "
                         "loaded in the run's dtype)")
    ap.add_argument("--max_num_seqs", type=int, default=0, help="engine batch; 0: all completions of a step")
    ap.add_argument("--micro_train_batch_size", type=int, default=16)
    ap.add_argument("--micro_rollout_batch_size", type=int, default=32)
    ap.add_argument("--gradient_checkpointing", default="auto", choices=["auto", "on", "off"],
                    help="both sides; auto: on for cuda")
    ap.add_argument("--adam_offload", action="store_true", help="rlhfkit --adam_offload")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl_prompts", type=int, nargs="*", default=None,
                    help="prompts per step of the TRL runs (default: --prompts); rlhfkit also runs at each")
    ap.add_argument("--trl_dtype", default="float32", choices=["float32", "bfloat16"],
                    help="TRL's model weights (float32: TRL's default, fp32 master + bf16 autocast like rlhfkit)")
    ap.add_argument("--trl_micro_train_batch_size", type=int, default=0,
                    help="TRL's per_device_train_batch_size (0: --micro_train_batch_size); TRL keeps full fp32 "
                         "logits, so a large micro batch that suits rlhfkit's fused head can run it out of memory")
    ap.add_argument("--switch_interval", type=float, default=None,
                    help="sys.setswitchinterval for the whole run (Python's GIL hand-over period, default 5 ms): "
                         "an experiment on the engine thread waiting for the GIL while episodes run Python")
    ap.add_argument("--skip_trl", action="store_true")
    ap.add_argument("--skip_rlhfkit", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rlhfkit_flags", default="", help="extra train_ppo flags for the rlhfkit runs, one string "
                    "(e.g. '--torch_compile --packing_samples'); recorded in the JSON")
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="after the timed steps, profile one more rlhfkit step: phases, GPU busy/idle, kernels "
                         "by class -> PREFIX_<prompts>.json and the run's record")
    ap.add_argument("--profile_trace", action="store_true", help="with --profile, keep the Chrome trace too")
    add_ray_args(ap)
    a = ap.parse_args(argv)
    a.model = a.model or ("qwen2-0.5b" if a.device.startswith("cuda") else "tiny")
    gc_on = {"auto": a.device.startswith("cuda"), "on": True, "off": False}
    a.gradient_checkpointing = gc_on[a.gradient_checkpointing]
    a.total_steps = a.warmup_steps + a.steps + 2  # + the profiled step and rollout
    a.trl_prompts = [] if a.skip_trl or a.ray_layout else (a.trl_prompts or [a.prompts])
    for name in ("prompts", "n", "prompt_len", "new_tokens", "steps"):
        if getattr(a, name) < 1:
            raise SystemExit(f"rl_step: --{name} must be >= 1")
    if a.n < 2:
        raise SystemExit("rl_step: --n must be >= 2 (GRPO groups)")
    return a


def headline(a: argparse.Namespace, runs: list[dict]) -> dict:
    """Top-level figures: rlhfkit at --prompts; TRL at --prompts if it ran there, else its largest batch."""
    ok = [r for r in runs if "error" not in r]
    rk = {r["prompts"]: r for r in ok if r["framework"] == "rlhfkit"}
    tr = {r["prompts"]: r for r in ok if r["framework"] == "trl"}
    out: dict[str, Any] = {}
    base = rk.get(a.prompts)
    if base:
        out.update(step_s=base["step_s"], phases_s=base["phases_s"], train_mfu=base.get("train_mfu"),
                   generate_share=base["generate_share"],
                   gen_tokens_per_s=base["gen_tokens_per_s"], response_length=base["response_length"])
        out.update({k: base[k] for k in RAY_HEADLINE if k in base})
    if tr:
        p = a.prompts if a.prompts in tr else max(tr)
        out.update(trl_prompts=p, trl_completions=p * a.n, trl_step_s=tr[p]["step_s"],
                   trl_generate_share=tr[p]["generate_share"])
        if p in rk and rk[p]["step_s"] and tr[p]["step_s"]:
            out.update(rlhfkit_step_s_at_trl_batch=rk[p]["step_s"], speedup_vs_trl=tr[p]["step_s"] / rk[p]["step_s"],
                       speedup_vs_trl_median=tr[p]["step_s_median"] / rk[p]["step_s_median"])
    return out



def report(a: argparse.Namespace, runs: list[dict], complete: bool) -> dict:
    res = {"bench": "rl_step", "device": device_name(a.device), "model": a.model, "prompts": a.prompts, "n": a.n,
           "completions": a.prompts * a.n, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
           "timed_steps": a.steps, "rollout_engine": a.rollout_engine, "ray_layout": a.ray_layout,
           "compute_dtype": "bf16" if a.device.startswith("cuda") else "fp32", "master_dtype": "fp32",
           "gradient_checkpointing": a.gradient_checkpointing, "adam_offload": a.adam_offload, "complete": complete,
           "switch_interval_s": sys.getswitchinterval(), "warmup_steps": a.warmup_steps,
           "versions": {d: package_version(d) for d in ("torch", "transformers", "accelerate", "trl", "datasets", "pyarrow", "ray")}}
    if not a.device.startswith("cuda"):
        res["load_avg_1m"] = os.getloadavg()[0]  # CPU timings are only as quiet as the machine was
    res.update(headline(a, runs))
    res["runs"] = runs
    write_report(a.out, res)
    return res


def guarded(fn: Callable[[], dict], framework: str, prompts: int, n: int) -> dict:
    """A failing run is recorded (error text) instead of losing the other runs' figures."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the bench reports and goes on
        import traceback

        traceback.print_exc()
        out = {"framework": framework, "prompts": prompts, "completions": prompts * n,
               "error": f"{type(e).__name__}: {e}"[:2000]}
    out["run_wall_s"] = time.perf_counter() - t0
    print(f"[rl_step] {framework} {prompts}x{n}: step_s={out.get('step_s')} error={out.get('error')} "
          f"(run {out['run_wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    with tempfile.TemporaryDirectory(prefix="rl_step_") as work:
        res = run_all(a, work)
    print(json.dumps(res))
    return res


def run_all(a: argparse.Namespace, work: str) -> dict:
    """Model, prompts and reward file under `work`; rlhfkit runs (largest batch first), then TRL runs."""
    import numpy as np

    model_dir = a.model_dir or os.path.join(work, f"model_{a.model}")
    make_bench_model(model_dir, a.model, device=a.device if a.device.startswith("cuda") else None, seed=a.seed,
                     disk_dtype=a.disk_dtype)
    free_memory(a.device)
    rng = np.random.default_rng(a.seed)
    biggest = max([a.prompts] + a.trl_prompts)
    prompts_text = [random_prompt(rng, a.prompt_len) for _ in range(biggest * a.total_steps)]
    runs: list[dict] = []
    sizes = [] if a.skip_rlhfkit else sorted({a.prompts, *a.trl_prompts}, reverse=True)
    run = run_ray if a.ray_layout else run_rlhfkit
    for p in sizes:
        reward, data = write_inputs(work, prompts_text[:p * a.total_steps])
        runs.append(guarded(lambda: run(a, model_dir, data, reward, work, p), "rlhfkit", p, a.n))
        free_memory(a.device)
        report(a, runs, complete=False)
    reward, _ = write_inputs(work, prompts_text)
    for p in sorted(set(a.trl_prompts)):
        runs.append(guarded(lambda: run_trl(a, model_dir, prompts_text, reward, work, p), "trl", p, a.n))
        free_memory(a.device)
        report(a, runs, complete=False)
    return report(a, runs, complete=True)


if __name__ == "__main__":
    main()
