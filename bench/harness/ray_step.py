"""Ray mode of bench/rl_step.py: the same GRPO step, run by train_ppo_ray's trainer on Ray actors.

    python bench/rl_step.py --ray_layout disaggregated --model qwen2-0.5b --prompts 16 --n 8 --new_tokens 256 \
        --steps 3 --out rl_step_ray_disaggregated.json
    python bench/rl_step.py --ray_layout colocated --device cpu --model tiny --prompts 4 --n 2 --new_tokens 8

Layouts (issue 6's on a 2-GPU machine, issue 13's on a 4-GPU one; `LAYOUTS` holds the flags):
    disaggregated  the policy on 1 GPU (`--actor_num_gpus_per_node 1`), 1 engine on another GPU;
                   weights by NCCL broadcast (`--weight_sync auto`)
    colocated      `--colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep` with
                   `--actor_num_gpus_per_node 2` (FSDP2 over both GPUs; `--ray_gpus`) and 2 engines, one
                   on each policy GPU; weights by CUDA IPC from the policy rank on the same GPU
    colocated_nosleep  the same without the two sleep flags (the baseline a sleep-mode step is
                   compared with: everything stays on the GPUs)
    colo4_tp1 / colo4_tp1_sleep   4 policy GPUs, 4 engines of TP 1 on them (sleep: both sleep flags)
    colo4_tp2 / colo4_tp2_sleep   4 policy GPUs, 2 engines of TP 2 on them (sleep: both sleep flags)
    disagg2_tp2 / disagg2_tp2_async   2 policy GPUs + 1 engine of TP 2 on the other 2 (NCCL
                                      broadcast to both shards), without / with --async_train
`--ray_extra "..."` appends flags (e.g. checkpointing). On CPU the slots are CPU workers and the
weights go by gloo broadcast.

Same model directory, prompts, reward, batch and flags as the one-process run (rl_step.py's
`rlhfkit_argv`: no reference model, GRPO, bf16 on GPU, min_new_tokens = max_new_tokens), plus the
layout's flags. The driver builds the trainer as `train_ppo_ray`'s RayLayout does (flags, placement, Ray
groups), runs `--warmup_steps` warm-up and `--steps` timed `train_step()` calls, and records per step:
the wall time; the loop's phases (generate, reward, logprobs, train, weight_sync; the rollout's
`generate` includes the states' offload and the engines' wake-up, `generate_only_s` is without
them); the Ray phases (engine sleep / wake, states reload / offload as the driver sees them and
`offload` / `reload` as the ranks measured them, `time/weight_push`: the push alone); `offload_gb`;
the synced MB and the sync path. Ray is started here (a local instance, whatever $RAY_ADDRESS says)
with the GPUs that torch sees and `--ray_object_store_gb` of object store; PYTHONPATH carries the
repo to the workers.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SLEEP = ["--vllm_enable_sleep", "--deepspeed_enable_sleep"]
LAYOUTS = {  # name -> (policy ranks, flags); the colocated pair scales with --ray_gpus
    "disaggregated": (1, ["--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1"]),
    "colocated": (0, ["--colocate_all_models", *_SLEEP]),
    "colocated_nosleep": (0, ["--colocate_all_models"]),
    "colo4_tp1": (4, ["--actor_num_gpus_per_node", "4", "--vllm_num_engines", "4", "--colocate_all_models"]),
    "colo4_tp1_sleep": (4, ["--actor_num_gpus_per_node", "4", "--vllm_num_engines", "4", "--colocate_all_models",
                            *_SLEEP]),
    "colo4_tp2": (4, ["--actor_num_gpus_per_node", "4", "--vllm_num_engines", "2",
                      "--vllm_tensor_parallel_size", "2", "--colocate_all_models"]),
    "colo4_tp2_sleep": (4, ["--actor_num_gpus_per_node", "4", "--vllm_num_engines", "2",
                            "--vllm_tensor_parallel_size", "2", "--colocate_all_models", *_SLEEP]),
    "disagg2_tp2": (2, ["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "2"]),
    "disagg2_tp2_async": (2, ["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1",
                              "--vllm_tensor_parallel_size", "2", "--async_train", "--async_queue_size", "1"]),
}
RAY_TIMES = ("weight_push", "engine_sleep", "engine_wake", "states_reload", "states_offload", "offload", "reload")
RAY_HEADLINE = ("ray_layout", "weight_sync_method", "weight_sync_s", "weight_push_s", "weight_sync_mb",
                "weight_sync_gb_per_s", "ray_phases_s")


def add_ray_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ray_layout", default=None, choices=sorted(LAYOUTS),
                    help="run train_ppo_ray's trainer on Ray in this layout (bench/harness/ray_step.py); TRL is skipped")
    ap.add_argument("--weight_sync", default="auto", choices=["auto", "object_store", "broadcast", "ipc"],
                    help="train_ppo_ray --weight_sync (Ray mode)")
    ap.add_argument("--weight_sync_bucket_mb", type=int, default=256, help="train_ppo_ray --weight_sync_bucket_mb")
    ap.add_argument("--ray_gpus", type=int, default=2, help="GPUs of the colocated layouts (policy ranks = engines)")
    ap.add_argument("--ray_object_store_gb", type=float, default=4.0, help="object store of the local Ray")
    ap.add_argument("--ray_extra", default="", help="more train_ppo_ray flags, space-separated")


def layout_argv(a: argparse.Namespace) -> list[str]:
    common = ["--weight_sync", a.weight_sync, "--weight_sync_bucket_mb", str(a.weight_sync_bucket_mb),
              "--ray_address", "local", "--ray_num_cpus_per_worker", "1"]
    if a.ray_layout not in LAYOUTS:
        raise ValueError(f"--ray_layout must be one of {sorted(LAYOUTS)}, got {a.ray_layout!r}")
    ranks, flags = LAYOUTS[a.ray_layout]
    if not ranks:  # the colocated pair: --ray_gpus policy ranks, one engine on each
        flags = ["--actor_num_gpus_per_node", str(a.ray_gpus), "--vllm_num_engines", str(a.ray_gpus), *flags]
    return common + flags + a.ray_extra.split()


def policy_ranks(a: argparse.Namespace) -> int:
    return LAYOUTS[a.ray_layout][0] or a.ray_gpus


class GpuMemoryPeak:
    """Peak used memory of every GPU (NVML, all processes: the Ray actors live in their own), polled
    every `interval_s` on a thread while the block runs; `peaks_gb` is empty without NVML."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s, self.peaks_gb = interval_s, []
        self._stop = None

    def __enter__(self) -> "GpuMemoryPeak":
        import threading

        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no NVML: no memory figures
            return self
        self.peaks_gb = [0.0] * len(handles)
        self._stop = threading.Event()

        def poll() -> None:
            while not self._stop.is_set():
                for i, h in enumerate(handles):
                    used = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30
                    self.peaks_gb[i] = max(self.peaks_gb[i], used)
                self._stop.wait(self.interval_s)
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=2)


def start_ray(a: argparse.Namespace) -> bool:
    """A local Ray with this machine's GPUs (torch's count); True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    path = os.environ.get("PYTHONPATH", "")
    if REPO not in path.split(os.pathsep):  # workers inherit the raylet's (this process's) environment
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, path) if p)
    for k, v in (("RAY_DISABLE_IMPORT_WARNING", "1"), ("RAY_USAGE_STATS_ENABLED", "0"),
                 ("RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE", "1")):
        os.environ.setdefault(k, v)
    gpus = torch.cuda.device_count() if a.device.startswith("cuda") else 0
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), num_gpus=gpus,
             object_store_memory=int(a.ray_object_store_gb * 2**30), include_dashboard=False, log_to_driver=True)
    return True


def plan_gib(args: Any, shapes: dict[str, Any]) -> dict[str, Any]:
    """The memory plan train_ppo_ray printed, per pool: GPUs, members and each phase in GiB."""
    from rlhfkit.rl_run import memory_check as M
    from rlhfkit.distributed.memory_plan import GiB, plan_memory

    device_bytes = M.gpu_bytes(args)
    plan = plan_memory(M.memory_inputs(args, {n: s.slots for n, s in shapes.items()}), device_bytes)
    return {"device_gib": device_bytes / GiB if device_bytes else None,
            "pools": {p.name: {"gpus": p.gpus, "members": p.members, "peak_gib": p.peak / GiB,
                               "expected_peak_gib": p.expected_peak / GiB,
                               "phases_gib": {k: v / GiB for k, v in p.phases.items()},
                               "parts_gib": {m: {c: v / GiB for c, v in parts.items()} for m, parts in p.parts.items()}}
                      for p in plan.pools}}


def nvml_processes() -> dict[int, dict[int, float]]:
    """GPU index -> {pid: GiB used} from NVML ({} without it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out[i] = {p.pid: (p.usedGpuMemory or 0) / 2**30 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        return out
    except Exception:  # noqa: BLE001 - no NVML: no per-process figures
        return {}


def memory_step(launched: Any) -> dict[str, Any]:
    """This step's peak reserved GiB of every role rank per method, and of every engine shard (its own
    process: weights, KV cache, CUDA graphs), read from the actors (each resets its peak)."""
    import ray

    from rlhfkit.distributed.workers import RoleWorker

    roles = {name: [{m: {k: v / 2**30 for k, v in p.items()} for m, p in peaks.items()}
                    for peaks in g.run_all(RoleWorker.memory_peaks)]
             for name, g in launched.groups.items()}
    engines = [{k: v / 2**30 for k, v in m.items()} for m in ray.get([a.memory.remote() for a in launched.router.shards])]
    return {"roles": roles, "engines": engines}


def measured_vs_plan(plan: dict[str, Any], steps: list[dict[str, Any]], nvml_peaks: list[float],
                     placement: list[dict]) -> dict[str, Any]:
    """Per pool: the plan's peak against (a) NVML's peak used memory of its GPUs (every process, CUDA
    contexts included) and (b) the torch peaks: the largest role method peak of a GPU plus the resident
    engine's peak; ratio = plan / measured, with the plan's expected peak (what the head may keep when there
    is room included)."""
    gpu_of = {}
    for p in placement:
        for g in p["gpu_ids"]:
            gpu_of.setdefault((p["pool"], p["role"], p["rank"]), int(g))
    out = {}
    for name, pool in plan["pools"].items():
        gpus = sorted({g for (pl, _, _), g in gpu_of.items() if pl == name})
        nv = max((nvml_peaks[g] for g in gpus if g < len(nvml_peaks)), default=None)
        torch_peak = 0.0
        for g in gpus:
            per_gpu = 0.0
            for (pl, role, rank), gg in gpu_of.items():
                if pl != name or gg != g:
                    continue
                if role == "engine":
                    per_gpu += max((st["engines"][rank].get("peak_reserved", 0.0) for st in steps
                                    if rank < len(st["engines"])), default=0.0)
                else:
                    per_gpu += max((max((p["reserved"] for p in st["roles"][role][rank].values()), default=0.0)
                                    for st in steps
                                    if role in st["roles"] and rank < len(st["roles"][role])), default=0.0)
            torch_peak = max(torch_peak, per_gpu)
        expected = pool.get("expected_peak_gib", pool["peak_gib"])
        out[name] = {"plan_peak_gib": pool["peak_gib"], "plan_expected_peak_gib": expected, "nvml_peak_gib": nv,
                     "torch_peak_sum_gib": torch_peak, "plan_over_nvml": expected / nv if nv else None}
    return out


def launch_trainer(a: argparse.Namespace, argv: list[str]) -> tuple[Any, Any, Any, Any, dict]:
    """train_ppo_ray's checks and launch -> (resolved flags, launched, trainer, seconds to launch, the memory
    plan's figures for the JSON: `plan_gib`)."""
    from rlhfkit.rl_run import builders as S
    from rlhfkit.rl_run import root as rl_root
    from rlhfkit.rl_run.resolve import resolve
    from rlhfkit.cli.common import set_seed
    from rlhfkit.cli.train_ppo_ray import build_parser
    from rlhfkit.rl_run import ray_layout as R
    from rlhfkit.rl_run.memory_check import check_memory

    parsed = build_parser().parse(argv)
    shapes = R.role_shapes(parsed)
    args = resolve(parsed, shapes["policy"].slots)
    R.check_ray_flags(args, shapes)
    check_memory(args, {name: s.slots for name, s in shapes.items()})
    memory_plan = plan_gib(args, shapes)
    set_seed(args.seed)
    data = rl_root.load_data(args)  # with --max_images_per_prompt: the pictures' processor and layout too
    num_steps = S.optimizer_steps(args, len(data.prompts))
    t0 = time.perf_counter()
    launched, phases = R.launch_roles(args, num_steps, shapes, hard_exit=False, tokenizer=data.tokenizer)
    try:
        trainer = R.build_ray_trainer(args, launched, phases, data)
    except BaseException:
        launched.shutdown()
        raise
    return args, launched, trainer, time.perf_counter() - t0, memory_plan


def run_ray(a: argparse.Namespace, model_dir: str, data: str, reward: str, work: str, prompts: int) -> dict:
    """Launch the layout, 1 warm-up + `a.steps` timed steps, shut the actors (and a Ray we started) down."""
    import ray

    from bench.harness.rl_run import force_full_length, micro, rlhfkit_argv, summarize_rlhfkit

    per_rank = prompts * a.n // policy_ranks(a)  # micro batches are per policy rank
    argv = rlhfkit_argv(a, model_dir, data, reward, work, prompts) + layout_argv(a) + [
        "--micro_train_batch_size", str(micro(per_rank, a.micro_train_batch_size)),
        "--micro_rollout_batch_size", str(micro(per_rank, a.micro_rollout_batch_size))]
    started = start_ray(a)
    launched = None
    try:
        print(f"[rl_step] ray {a.ray_layout}: launching ({ray.cluster_resources()})", flush=True)
        args, launched, trainer, launch_s, memory_plan = launch_trainer(a, argv)
        print(f"[rl_step] ray {a.ray_layout}: launched in {launch_s:.1f} s; weight sync "
              f"{launched.weight_sync.describe()}", flush=True)
        min_new = force_full_length(trainer)
        with GpuMemoryPeak() as mem:
            walls, metrics = timed_steps(trainer, a.steps, a.ray_layout, a.warmup_steps, launched)
        steps_mem = [m.pop("_memory") for m in metrics if "_memory" in m]
        trainer.logger.close()
        out = summarize_rlhfkit(walls, metrics, prompts * a.n)
        out.update(ray_summary(metrics, launched, launch_s))
        out.update(prompts=prompts, completions=prompts * a.n, min_new_tokens=min_new,
                   micro_train_batch_size=args.micro_train_batch_size,
                   micro_rollout_batch_size=args.micro_rollout_batch_size, ray_layout=a.ray_layout,
                   argv_extra=layout_argv(a), gpu_peak_mem_gb=mem.peaks_gb)
        out.update(memory_plan=memory_plan, memory_steps=steps_mem, memory_processes_gib=nvml_processes(),
                   memory_check=measured_vs_plan(memory_plan, steps_mem, mem.peaks_gb, out["placement"]))
        return out
    finally:
        if launched is not None:
            launched.shutdown()
        if started:
            ray.shutdown()


def timed_steps(trainer: Any, steps: int, layout: str, warmup: int = 1,
                launched: Any = None) -> tuple[list[float], list[dict]]:
    """rl_step's `time_steps` (`warmup` untimed steps first) with a progress line per step; the driver
    holds no GPU work to wait for (each step's Ray calls return after the actors finished). With
    `launched`, each timed step's metrics carry its memory peaks under "_memory" (memory_step)."""
    walls: list[float] = []
    metrics: list[dict] = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        m = trainer.train_step()
        trainer.state.step += 1
        wall = time.perf_counter() - t0
        split = " ".join(f"{k}={m.get(f'time/{k}', 0.0):.2f}" for k in ("generate", "logprobs", "train", "weight_sync"))
        print(f"[rl_step] ray {layout}: step {i}{' (warm-up)' if i < warmup else ''} {wall:.2f} s ({split}; "
              f"push {m.get('time/weight_push', 0.0):.3f} s, {m.get('weight_sync_mb', 0.0):.0f} MB; "
              f"states offload {m.get('time/states_offload', 0.0):.2f} s)", flush=True)
        memory = memory_step(launched) if launched is not None else None  # resets the peaks each step
        if i >= warmup:
            walls.append(wall)
            if memory is not None:
                m["_memory"] = memory
            metrics.append(m)
    return walls, metrics


def ray_summary(metrics: list[dict], launched: Any, launch_s: float) -> dict:
    """Weight-sync figures, the Ray-only phases and the placement of every actor."""
    from bench.harness.timing import mean

    times = {k: mean([m.get(f"time/{k}", 0.0) for m in metrics]) for k in RAY_TIMES}
    mb = mean([m.get("weight_sync_mb", 0.0) for m in metrics])
    push = times["weight_push"]
    methods = sorted({k.split("/", 1)[1] for m in metrics for k in m if k.startswith("weight_sync/")})
    # the rollout's phase includes what happens before the engines generate: the training states'
    # offload and the engines' wake-up (sleep layouts); without them, generation alone (logged by the
    # loop as time/generate_engines; the async producer's generation has no such figure)
    gen_only = mean([m["time/generate_engines"] if "time/generate_engines" in m else
                     m.get("time/generate", 0.0) - m.get("time/states_offload", 0.0) - m.get("time/engine_wake", 0.0)
                     for m in metrics])
    return {"ray_phases_s": times, "generate_only_s": gen_only,
            "offload_gb": mean([m.get("offload_gb", 0.0) for m in metrics]),
            "weight_sync_s": mean([m["time/weight_sync"] for m in metrics]),
            "weight_push_s": push, "weight_sync_mb": mb,
            "weight_sync_gb_per_s": mb / 1024 / push if push else None,
            "weight_sync_method": launched.weight_sync.describe(), "weight_sync_methods_logged": methods,
            "launch_s": launch_s, "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "placement": [{k: p[k] for k in ("role", "rank", "pool", "bundle", "gpu_ids")} for p in launched.placement]}
