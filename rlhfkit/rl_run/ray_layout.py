"""train_ppo_ray's placement: the role groups and rollout engines as Ray actors, the loop in the driver
(`RayLayout`, a `rlhfkit.rl_run.root.Layout`), with the checks and notes of the placement flags. The actors
and the weight paths between them are drawn in rlhfkit.cli.train_ppo_ray's docstring (its --help).

The actors build their roles and engines with `build_role` / `build_engine` from the resolved flags and
the driver's tokenizer (sent with them: no actor loads it again).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from rlhfkit.cli.common import UsageError, note_cpu_dtype, set_seed
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.rl_run import builders as S
from rlhfkit.rl_run import root as R
from rlhfkit.trainers.async_rl import AsyncRLTrainer
from rlhfkit.weightsync.flags import DEFAULT_BUCKET_MB, METHODS

log = logging.getLogger(__name__)

PROG = "train_ppo_ray"
VLLM_ONLY = ("vllm_gpu_memory_utilization", "enable_prefix_caching", "enforce_eager")
NO_EFFECT = ("vllm_sync_with_ray",)  # --weight_sync picks the path; torch process groups, not ray.util.collective


# ----------------------------------------------------------------------------- plan and checks


def role_shapes(args) -> dict[str, Any]:
    from rlhfkit.distributed.placement import Shape

    flags = {"policy": ("actor", args.actor_num_nodes, args.actor_num_gpus_per_node),
             "ref": ("ref", args.ref_num_nodes, args.ref_num_gpus_per_node),
             "critic": ("critic", args.critic_num_nodes, args.critic_num_gpus_per_node),
             "reward": ("reward", args.reward_num_nodes, args.reward_num_gpus_per_node)}
    return {r: Shape(flags[r][1], flags[r][2], flags[r][0]) for r in S.roles_in_run(args)}


def check_ray_flags(args, shapes: dict[str, Any]) -> None:
    from rlhfkit.distributed.placement import plan_pools

    if args.load_in_4bit:
        raise UsageError("--load_in_4bit: train_ppo_ray's engines are actors of their own, which cannot serve the "
                         "policy's 4-bit base; QLoRA RL runs in train_ppo (one process, the builtin engine serving "
                         "the policy's weights)")
    plan_pools(shapes, args.vllm_num_engines, args.vllm_tensor_parallel_size, colocate_all=args.colocate_all_models,
               colocate_actor_ref=args.colocate_actor_ref, colocate_critic_reward=args.colocate_critic_reward)
    if args.async_train and args.vllm_enable_sleep and not args.colocate_all_models:
        raise UsageError("--async_train keeps the engines generating during training: --vllm_enable_sleep "
                         "would have nothing to free; drop one of them")
    if args.async_train and args.async_queue_size < 1:
        raise UsageError(f"--async_queue_size must be >= 1, got {args.async_queue_size}")
    if args.vllm_tensor_parallel_size > 1 and args.rollout_engine != "builtin":
        raise UsageError(f"--vllm_tensor_parallel_size {args.vllm_tensor_parallel_size} needs --rollout_engine "
                         f"builtin (tensor-parallel engines are the builtin engine's; {args.rollout_engine} "
                         "runs on one device); use more --vllm_num_engines instead")
    if args.partial_rollout and not args.async_train:
        raise UsageError("--partial_rollout needs --async_train (as in OpenRLHF): without it each batch is "
                         "generated and trained before the next weight update, so no generation is in flight "
                         "at an update")
    if args.partial_rollout and args.rollout_engine != "builtin":
        raise UsageError(f"--partial_rollout needs --rollout_engine builtin: it loads weights between decode "
                         f"steps with generations in flight, which the {args.rollout_engine} engine cannot")
    if getattr(args, "weight_sync", "auto") not in METHODS:
        raise UsageError(f"--weight_sync {args.weight_sync!r}: choose one of {', '.join(METHODS)}")
    if getattr(args, "weight_sync_bucket_mb", DEFAULT_BUCKET_MB) < 1:
        raise UsageError(f"--weight_sync_bucket_mb must be >= 1, got {args.weight_sync_bucket_mb}")
    if args.vllm_sync_backend not in ("nccl", "gloo"):
        raise UsageError(f"--vllm_sync_backend must be nccl or gloo, got {args.vllm_sync_backend!r}")
    if args.vllm_num_engines > args.rollout_batch_size and not args.rollout_max_num_seqs:
        raise UsageError(f"--vllm_num_engines ({args.vllm_num_engines}) exceeds --rollout_batch_size "
                         f"({args.rollout_batch_size}): some engines would get no slots; set --rollout_max_num_seqs")


def async_mode(args) -> str:
    """sync; overlap (async: generation runs while the roles train); turns (async, colocated
    engines that sleep while the roles work: generation and training cannot overlap)."""
    if not args.async_train:
        return "sync"
    return "turns" if args.colocate_all_models and args.vllm_enable_sleep else "overlap"


def warn_async(args) -> None:
    """One line each: what --async_train does with colocated engines; --partial_rollout without IS correction."""
    mode = async_mode(args)
    if mode == "overlap" and args.colocate_all_models:
        log.warning("warning: --async_train with --colocate_all_models: the engines share the training GPUs and "
                    "generate the next batch while the roles train, so both hold GPU memory at once (OpenRLHF "
                    "colocates only the training models here)")
    elif mode == "turns":
        extra = "; --partial_rollout then has no generation in flight at a weight update" if args.partial_rollout \
            else ""
        log.warning("warning: --async_train with --colocate_all_models --vllm_enable_sleep: the engines sleep while "
                    "the roles work, so generation and training take turns on the shared GPUs instead of overlapping; "
                    "each batch is still generated up to --async_queue_size steps ahead of the policy that trains on "
                    f"it{extra}")
    if args.partial_rollout and not args.enable_vllm_is_correction:
        log.info("note: --partial_rollout mixes policy versions inside a sample; --enable_vllm_is_correction weights "
                 "each token by its own rollout log-prob")


def note_no_effect(args, parser) -> None:
    changed = [d for d in (*VLLM_ONLY, *NO_EFFECT) if getattr(args, d) != parser.get_default(d)]
    vllm_only = [d for d in changed if d in VLLM_ONLY and args.rollout_engine != "vllm"]
    none = [d for d in changed if d in NO_EFFECT]
    if vllm_only:
        log.info(f"note: {', '.join('--' + d for d in vllm_only)} take effect with --rollout_engine vllm only")
    if none:
        log.info(f"note: {', '.join('--' + d for d in none)} have no effect: --weight_sync picks the weight path")
    if args.engine_weights == "shared":
        log.info("note: --engine_weights shared has no effect in train_ppo_ray: its engines are actors of their own, "
                 "each with its copy of the weights (train_ppo in one process shares them)")


# ----------------------------------------------------------------------------- builders (run in actors)


def build_role(args, num_steps: int, tokenizer: Any, role: str, dist: DistInfo) -> tuple[Any, Any]:
    """One rank of `role` (runs inside its Ray actor) -> (role object, backend or None); `tokenizer`: the
    driver's (PPO-ptx data), sent with the flags."""
    set_seed(args.seed, args.full_determinism)
    from rlhfkit.cli.common import parallel_dims
    from rlhfkit.parallel.mesh import attach_mesh

    dist = attach_mesh(dist, parallel_dims(args, dist))  # this group's dp / tp / cp process groups
    if role == "policy":
        return S.build_policy(args, dist, num_steps, tokenizer=tokenizer)
    if role == "ref":
        ref = S.build_ref(args, dist)
        return ref, ref.backend
    if role == "critic":
        return S.build_critic(args, dist, num_steps)
    if role == "reward":
        return S.build_reward_model(args, dist), None
    raise ValueError(f"unknown role {role!r}")


def build_engine(args, tokenizer: Any, dist: DistInfo, tp: Any = None) -> Any:
    """One rollout engine, or one shard of a tensor-parallel one (`tp`), inside its Ray actor, with the
    driver's `tokenizer` (sent with the flags); vLLM also gets the --vllm_* / engine flags."""
    if args.rollout_engine != "vllm":
        return S.build_engine_for(args, tokenizer, dist, tp)
    import torch

    from rlhfkit.rollout import build_engine as make_engine

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.param_dtype, torch.float32)
    return make_engine("vllm", args.pretrain, tokenizer, dtype=dtype, seed=args.seed, max_model_len=args.max_len,
                       gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                       enable_sleep_mode=args.vllm_enable_sleep, enable_prefix_caching=args.enable_prefix_caching,
                       enforce_eager=args.enforce_eager)


# ----------------------------------------------------------------------------- run


def _weights_dtype(args, accelerator: str) -> str | None:
    on_gpu = args.device.startswith("cuda") if args.device else accelerator == "GPU"
    if not on_gpu:
        return None
    return {"bf16": "bfloat16", "fp16": "float16"}.get(args.param_dtype)


def _exit_after(grace_s: float):
    """on_failure for the health monitor: end the process if the main thread hasn't within grace_s."""
    def on_failure(failure) -> None:
        def later() -> None:
            time.sleep(grace_s)
            log.error(f"{PROG}: error: {failure}")
            os._exit(1)
        threading.Thread(target=later, daemon=True).start()
    return on_failure


def launch_roles(args, num_steps: int, shapes: dict[str, Any], hard_exit: bool, tokenizer: Any):
    from rlhfkit.distributed.group import Phases
    from rlhfkit.distributed.health import HealthMonitor
    from rlhfkit.distributed.launch import EngineSpec, LaunchConfig, RoleSpec, launch
    from rlhfkit.distributed.placement import SlotResources, detect_accelerator

    accel = detect_accelerator(args.ray_accelerator_resource)
    if _weights_dtype(args, accel) is None:  # the roles train on CPUs
        note_cpu_dtype(args, "cpu")
    monitor = HealthMonitor(args.ray_health_interval, on_failure=_exit_after(10.0) if hard_exit else None)
    phases = Phases(engine_sleep=args.vllm_enable_sleep, train_sleep=args.deepspeed_enable_sleep,
                    rollout_flush=async_mode(args) != "overlap")
    builder = functools.partial(build_role, args, num_steps, tokenizer)
    roles = [RoleSpec(name, shape, builder) for name, shape in shapes.items()]
    engines = EngineSpec(args.vllm_num_engines, args.vllm_tensor_parallel_size, functools.partial(build_engine, args, tokenizer))
    cfg = LaunchConfig(resources=SlotResources(accel, args.ray_num_cpus_per_worker), device=args.device,
                       colocate_all=args.colocate_all_models, colocate_actor_ref=args.colocate_actor_ref,
                       colocate_critic_reward=args.colocate_critic_reward,
                       placement_timeout_s=args.ray_placement_timeout, unit=args.n_samples_per_prompt,
                       weights_dtype=_weights_dtype(args, accel), weight_sync=getattr(args, "weight_sync", "auto"),
                       weight_sync_bucket_bytes=getattr(args, "weight_sync_bucket_mb", DEFAULT_BUCKET_MB) * 2**20,
                       weight_sync_backend=args.vllm_sync_backend, engine_direct=args.rollout_engine != "vllm")
    launched = launch(roles, engines, cfg, monitor, phases)
    for p in launched.placement:
        log.info(f"placement: {p['role']} rank {p['rank']} pid {p['pid']} node {p['node_id'][:12]} ({p['ip']}) "
                 f"pool {p['pool']} bundle {p['bundle']} gpus {p['gpu_ids']}")
    transport = launched.weight_sync.describe() if launched.weight_sync is not None else "none"
    log.info(f"weight sync: {transport}, buckets of "
             f"{getattr(args, 'weight_sync_bucket_mb', DEFAULT_BUCKET_MB)} MB")
    return launched, phases


def ray_placement(launched) -> R.Placement:
    """The Ray groups and the engine router as the loop sees them (root.Placement)."""
    from rlhfkit.distributed.group import GroupBackend
    from rlhfkit.roles.handles import (
        CriticHandle,
        PolicyHandle,
        ReferenceHandle,
        RewardHandle,
    )

    g = launched.groups
    critic = g.get("critic")
    ref, reward = g.get("ref"), g.get("reward")
    return R.Placement(DistInfo(), PolicyHandle(g["policy"]), launched.router, GroupBackend(g["policy"]),
                       launched.sync, ref=ReferenceHandle(ref) if ref is not None else None,
                       critic=CriticHandle(critic) if critic is not None else None,
                       reward=RewardHandle(reward) if reward is not None else None,
                       critic_backend=GroupBackend(critic) if critic is not None else None,
                       save_critic=R.critic_saver_on_group(critic) if critic is not None else None)


def build_ray_trainer(args, launched, phases, data: R.RLData) -> AsyncRLTrainer:
    """The loop over the launched actors, on the plan's data (tokenizer, prompts, a VLM's pictures)."""
    return R.build_trainer(args, ray_placement(launched), data,
                           AsyncRLTrainer, router=launched.router, phases=phases, monitor=launched.monitor,
                           async_queue_size=args.async_queue_size if args.async_train else 0,
                           partial_rollout=args.partial_rollout, take_turns=async_mode(args) == "turns")


class RayLayout:
    """train_ppo_ray: the role groups and engines as Ray actors, the loop in this driver (root.Layout)."""

    local = False

    def __init__(self, hard_exit: bool = False) -> None:
        self.hard_exit = hard_exit
        self.shapes: dict[str, Any] = {}

    def world(self, args) -> int:
        from rlhfkit.trainers.stop import current as stop_signals

        stop_signals().can_abandon = False  # a step of Ray actors always finishes before the stop checkpoint
        self.shapes = role_shapes(args)
        return self.shapes["policy"].slots

    def check(self, args, parser) -> None:
        check_ray_flags(args, self.shapes)
        warn_async(args)
        note_no_effect(args, parser)

    def roles(self, args) -> dict[str, int]:
        return {name: s.slots for name, s in self.shapes.items()}

    def plans_memory(self) -> bool:
        return True

    @contextmanager
    def place(self, plan: R.RLPlan) -> Iterator[tuple[R.Placement, AsyncRLTrainer]]:
        from rlhfkit.rewards.process_pool import close_pools
        from rlhfkit.usercode.run import shutdown_user_threads
        from rlhfkit.distributed.launch import connect

        if not plan.given.empty:
            raise UsageError("train_ppo_ray builds its models inside Ray actors from directories; models given in "
                             "memory train with train_ppo")
        args = plan.args
        started = connect(args.ray_address)
        launched = None
        try:
            launched, phases = launch_roles(args, plan.num_steps, self.shapes, self.hard_exit, plan.tokenizer)
            trainer = build_ray_trainer(args, launched, phases, plan.data)
            yield ray_placement(launched), trainer
        finally:
            close_pools()  # the driver's reward workers (the executors run in the driver)
            if launched is not None:
                stuck = shutdown_user_threads(5.0)  # reward_func / agent threads of the driver's executors
                if stuck:
                    log.info(f"note: {stuck} reward_func / agent call(s) still running after 5 s were abandoned")
                launched.shutdown()
            if started:
                import ray

                ray.shutdown()


