"""Flags -> RL components for train_ppo (and train_ppo_ray): checks, roles, engine, executors.

This is the one place where the RL command's namespace is read; everything it builds takes its
own config object.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.agents.base import AgentConfig
from rlhfkit.algo.advantages import AdvantageConfig, get_advantage_estimator
from rlhfkit.algo.experience import RewardShapingConfig
from rlhfkit.algo.kl import make_kl_controller
from rlhfkit.backend.dist import DistInfo
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.backend.parallel import ParallelDims
from rlhfkit.cli.common import UsageError, check_backend_flags, check_positions, parallel_dims
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig, from_args
from rlhfkit.config.rl_flags import RAY_ONLY
from rlhfkit.losses.policy import PolicyLossConfig
from rlhfkit.roles.actor import ActorRole, UpdateConfig
from rlhfkit.roles.critic import CriticRole, RewardModelRole
from rlhfkit.roles.group import LocalGroup
from rlhfkit.trainers.rl import RLLoopConfig
from rlhfkit.types import SamplingParams


def resolve_flags(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived defaults and reject inconsistent settings with the flags' names."""
    if not args.pretrain:
        raise UsageError("--pretrain is required (the policy's Hugging Face directory)")
    if not args.prompt_data:
        raise UsageError("--prompt_data is required")
    check_backend_flags(args)
    if args.clip_eps_low is not None or args.clip_eps_high is not None:
        lo = args.clip_eps_low if args.clip_eps_low is not None else args.eps_clip
        hi = args.clip_eps_high if args.clip_eps_high is not None else args.eps_clip
        args.eps_clip_low_high = [lo, hi]
    if args.use_icepop:
        args.enable_vllm_is_correction, args.vllm_is_correction_type = True, "icepop"
    if args.ref_reward_offload:
        args.ref_offload = args.reward_offload = True
    dynamic_new_tokens = args.generate_max_len is None and args.max_len is not None
    if args.generate_max_len is None:  # OpenRLHF: 1024 (flat era); max_len - prompt (--rollout.max_new_tokens unset)
        args.generate_max_len = args.max_len if dynamic_new_tokens else 1024
    if args.max_len is None:
        args.max_len = args.prompt_max_len + args.generate_max_len
        check_positions(args.pretrain, args.max_len, f"--prompt_max_len {args.prompt_max_len} + --generate_max_len "
                        f"{args.generate_max_len} = {args.max_len} (the default --max_len)")
    else:
        check_positions(args.pretrain, args.max_len, f"--max_len {args.max_len}")
    if args.agent_func_path and args.remote_rm_url:
        raise UsageError("--agent_func_path and --remote_rm_url are exclusive: the agent's step() gives the reward")
    has_reward = bool(args.remote_rm_url or args.agent_func_path or args.reward_pretrain)
    if not has_reward:
        raise UsageError("no reward: pass --reward_pretrain, --remote_rm_url (URL or reward_func .py) "
                         "or --agent_func_path")
    spec = get_advantage_estimator(args.advantage_estimator)
    if spec.group and args.n_samples_per_prompt <= 1:
        raise UsageError(f"--advantage_estimator {args.advantage_estimator} needs --n_samples_per_prompt > 1")
    if args.dynamic_filtering:
        if args.n_samples_per_prompt <= 1:
            raise UsageError("--dynamic_filtering needs --n_samples_per_prompt > 1")
        if not (args.remote_rm_url or args.agent_func_path):
            raise UsageError("--dynamic_filtering needs --remote_rm_url or --agent_func_path (0-1 scores)")
    if args.critic_pretrain and args.advantage_estimator != "gae":
        print(f"note: --critic_pretrain is unused with --advantage_estimator {args.advantage_estimator} (no critic)")
    per = args.micro_train_batch_size * world_size
    if args.train_batch_size % per:
        raise UsageError(f"--train_batch_size ({args.train_batch_size}) must be a multiple of "
                         f"--micro_train_batch_size ({args.micro_train_batch_size}) x world size ({world_size})")
    total = args.rollout_batch_size * args.n_samples_per_prompt
    if total % args.train_batch_size and not args.dynamic_filtering:
        raise UsageError(f"--rollout_batch_size x --n_samples_per_prompt ({total}) must be a multiple of "
                         f"--train_batch_size ({args.train_batch_size})")
    if args.rollout_batch_size % world_size:
        raise UsageError(f"--rollout_batch_size ({args.rollout_batch_size}) must be a multiple of the world size "
                         f"({world_size})")
    if args.max_failed_steps < 1:
        raise UsageError(f"--max_failed_steps must be >= 1, got {args.max_failed_steps}")
    if args.max_filter_rounds < 1:
        raise UsageError(f"--max_filter_rounds must be >= 1, got {args.max_filter_rounds}")
    if args.generate_max_len >= args.max_len and not dynamic_new_tokens:
        raise UsageError(f"--generate_max_len ({args.generate_max_len}) must be below --max_len ({args.max_len})")


def note_ray_only_flags(args: argparse.Namespace, parser: Any, prog: str) -> None:
    """One line naming the placement/engine flags that only train_ppo_ray uses."""
    set_flags = [d for d in RAY_ONLY if getattr(args, d) != parser.get_default(d)]
    if set_flags:
        names = ", ".join("--" + d for d in set_flags)
        print(f"note: {prog} runs in one process per rank; {names} take effect in train_ppo_ray only")


def actor_update_cfg(args: argparse.Namespace) -> UpdateConfig:
    return UpdateConfig(train_batch_size=args.train_batch_size, micro_train_batch_size=args.micro_train_batch_size,
                        max_epochs=args.max_epochs, seed=args.seed, temperature=args.temperature,
                        use_kl_loss=args.use_kl_loss, kl_estimator=args.kl_estimator,
                        max_tokens_per_micro=args.train_max_tokens_per_gpu if args.use_dynamic_batch else None,
                        packing=args.packing_samples)


def rollout_max_tokens(args: argparse.Namespace) -> int | None:
    """Token budget of the experience-making micro-batches under --use_dynamic_batch."""
    if not args.use_dynamic_batch:
        return None
    return args.rollout_max_tokens_per_gpu or args.train_max_tokens_per_gpu


def optimizer_steps(args: argparse.Namespace, num_prompts: int) -> int:
    steps = (num_prompts // args.rollout_batch_size) * args.num_episodes
    if args.max_steps:
        steps = min(steps, args.max_steps)
    per_step = -(-args.rollout_batch_size * args.n_samples_per_prompt // args.train_batch_size)
    return max(1, steps * per_step * args.max_epochs)


def backend_cfg(args: argparse.Namespace) -> BackendConfig:
    return from_args(BackendConfig, args)


def build_policy(args: argparse.Namespace, dist: DistInfo, num_steps: int, dims: ParallelDims | None = None):
    from rlhfkit.models.loader import load_causal_lm

    model = load_causal_lm(from_args(ModelConfig, args), master_dtype="fp32")
    optim = from_args(OptimConfig, args, learning_rate=args.actor_learning_rate)
    backend = FSDP2Backend(model, backend_cfg(args), optim, num_steps, dist, parallel=dims or parallel_dims(args, dist))
    loss_cfg = PolicyLossConfig.from_flags(
        policy_loss_type=args.policy_loss_type, eps_clip=args.eps_clip, eps_clip_low_high=args.eps_clip_low_high,
        dual_clip=args.dual_clip, enable_vllm_is_correction=args.enable_vllm_is_correction,
        vllm_is_correction_type=args.vllm_is_correction_type,
        vllm_is_truncated_threshold=args.vllm_is_truncated_threshold, entropy_loss_coef=args.entropy_loss_coef)
    role = ActorRole(backend, dist, loss_cfg, actor_update_cfg(args), args.micro_rollout_batch_size,
                     rollout_max_tokens(args), args.packing_samples)
    return LocalGroup(role, "policy"), backend


def build_ref(args: argparse.Namespace, dist: DistInfo, dims: ParallelDims | None = None):
    if args.init_kl_coef <= 0:
        return None
    from rlhfkit.models.loader import load_causal_lm

    cfg = from_args(ModelConfig, args, lora_rank=0, gradient_checkpointing=False)
    model = load_causal_lm(cfg, path=args.ref_pretrain or args.pretrain, flag="--ref_pretrain")
    backend = FSDP2Backend(model, backend_cfg(args), None, 0, dist, parallel=dims or parallel_dims(args, dist))
    role = ActorRole(backend, dist, micro_rollout_batch_size=args.micro_rollout_batch_size,
                     rollout_max_tokens=rollout_max_tokens(args), packing=args.packing_samples)
    return LocalGroup(role, "ref")


def critic_path(args: argparse.Namespace) -> str:
    if args.critic_pretrain:
        return args.critic_pretrain
    if args.reward_pretrain:
        return args.reward_pretrain.split(",")[0]
    return args.pretrain


def build_critic(args: argparse.Namespace, dist: DistInfo, num_steps: int, dims: ParallelDims | None = None):
    if args.advantage_estimator != "gae":
        return None, None
    from rlhfkit.models.value import checkpoint_keys, load_value_model

    path = critic_path(args)
    fresh = f"{args.value_head_prefix}.weight" not in checkpoint_keys(path)
    model = load_value_model(path, args.value_head_prefix, init_value_head=fresh, dtype=torch.float32,
                             normalize_reward=False, cfg=from_args(ModelConfig, args, pretrain=path),
                             flag="--critic_pretrain")
    optim = from_args(OptimConfig, args, learning_rate=args.critic_learning_rate)
    backend = FSDP2Backend(model, backend_cfg(args), optim, num_steps, dist, parallel=dims or parallel_dims(args, dist))
    upd = actor_update_cfg(args)
    role = CriticRole(backend, dist, upd, args.value_clip, args.micro_rollout_batch_size, rollout_max_tokens(args))
    return LocalGroup(role, "critic"), backend


def build_reward_model(args: argparse.Namespace, dist: DistInfo):
    if not args.reward_pretrain or args.remote_rm_url or args.agent_func_path:
        return None
    from rlhfkit.models.loader import resolve_dtype
    from rlhfkit.models.value import load_value_model

    dtype = resolve_dtype(args.param_dtype) if dist.device.startswith("cuda") else torch.float32
    models = [load_value_model(p, args.value_head_prefix, dtype=dtype, normalize_reward=args.normalize_reward,
                               attn_implementation=args.attn_implementation, device=dist.device,
                               flag="--reward_pretrain")
              for p in args.reward_pretrain.split(",") if p]
    return LocalGroup(RewardModelRole(models, dist, args.micro_rollout_batch_size), "reward")


def engine_max_num_seqs(args: argparse.Namespace, num_engines: int) -> int:
    """Sequences one engine decodes at once: --rollout_max_num_seqs, else its share of a step's samples (<= 512)."""
    per_rank = args.rollout_batch_size // num_engines * args.n_samples_per_prompt
    return args.rollout_max_num_seqs or min(per_rank, 512)


def build_engine_for(args: argparse.Namespace, tokenizer: Any, dist: DistInfo, tp: Any = None):
    from rlhfkit.rollout import build_engine

    gpu = dist.device.startswith("cuda")
    dtype = (torch.bfloat16 if args.param_dtype == "bf16" else torch.float16 if args.param_dtype == "fp16"
             else torch.float32) if gpu else torch.float32
    seqs = engine_max_num_seqs(args, dist.world_size)
    opts: dict[str, Any] = {}
    if args.rollout_engine == "builtin":
        opts = {"max_model_len": args.max_len, "max_num_seqs": seqs}
    elif args.rollout_engine == "hf":
        opts = {"max_batch_size": seqs}
    return build_engine(args.rollout_engine, args.pretrain, tokenizer, device=dist.device, dtype=dtype, tp=tp, **opts)


def close_rollout(engine: Any, user_code_grace_s: float = 5.0) -> None:
    """End the engine's worker thread and the threads running user code (reward_func, agents),
    success or failure: a daemon thread still inside torch when the interpreter exits aborts it
    ("terminate called without an active exception")."""
    from rlhfkit.agents.user_code import shutdown_user_threads

    close = getattr(engine, "close", None)
    if callable(close):
        try:
            close()
        except Exception as e:  # noqa: BLE001 - must not hide the error that ended the run
            print(f"note: closing the rollout engine failed: {type(e).__name__}: {e}")
    stuck = shutdown_user_threads(user_code_grace_s)
    if stuck:
        print(f"note: {stuck} reward_func / agent call(s) still running after {user_code_grace_s:g} s were "
              "abandoned")


def agent_config(args: argparse.Namespace, temperature: float) -> AgentConfig:
    sp = SamplingParams(temperature=temperature, top_p=args.top_p, top_k=args.top_k,
                        max_new_tokens=args.generate_max_len, seed=args.seed)
    return AgentConfig(max_length=args.max_len, sampling_params=sp, step_timeout_s=args.reward_timeout,
                       reward_timeout_s=args.reward_timeout, reward_failure=args.reward_failure)


def build_executor(args: argparse.Namespace, engine: Any, tokenizer: Any, temperature: float):
    from rlhfkit.agents.executors import SingleTurnAgentExecutor
    from rlhfkit.agents.loader import build_agent_executor
    from rlhfkit.agents.reward_func import make_reward_source

    cfg = agent_config(args, temperature)
    if args.agent_func_path:
        return build_agent_executor(args.agent_func_path, engine, tokenizer, cfg)
    source = make_reward_source(args.remote_rm_url, args.reward_timeout) if args.remote_rm_url else None
    return SingleTurnAgentExecutor().setup(engine, tokenizer, cfg, reward_source=source)


def loop_config(args: argparse.Namespace) -> RLLoopConfig:
    return RLLoopConfig(
        rollout_batch_size=args.rollout_batch_size, n_samples_per_prompt=args.n_samples_per_prompt,
        num_episodes=args.num_episodes, max_steps=args.max_steps, seed=args.seed, temperature=args.temperature,
        init_kl_coef=args.init_kl_coef, kl_estimator=args.kl_estimator, use_kl_loss=args.use_kl_loss,
        dynamic_filtering=args.dynamic_filtering,
        dynamic_filtering_reward_range=tuple(args.dynamic_filtering_reward_range),
        max_filter_rounds=args.max_filter_rounds,
        freezing_actor_steps=args.freezing_actor_steps, logging_steps=args.logging_steps,
        eval_steps=args.eval_steps, eval_temperature=args.eval_temperature,
        eval_n_samples_per_prompt=args.eval_n_samples_per_prompt, save_steps=args.save_steps,
        ckpt_path=args.ckpt_path, max_ckpt_num=args.max_ckpt_num, load_checkpoint=args.load_checkpoint,
        show_progress=not args.disable_progress, max_failed_steps=args.max_failed_steps)


def advantage_config(args: argparse.Namespace) -> AdvantageConfig:
    return from_args(AdvantageConfig, args, reward_clip_range=tuple(args.reward_clip_range))


def shaping_config(args: argparse.Namespace) -> RewardShapingConfig:
    return from_args(RewardShapingConfig, args)


def kl_controller(args: argparse.Namespace):
    return make_kl_controller(args.init_kl_coef, args.kl_target, args.kl_horizon)


@dataclass
class RLCheckpointer:
    """Saves/loads the trainable roles' checkpoints under one root (actor/, critic/).

    The critic is saved first and keeps one checkpoint more than --max_ckpt_num; the actor's
    checkpoint completes the pair. Loading takes the newest actor checkpoint whose critic
    checkpoint of the same tag is complete, so a kill between the two saves (or during either)
    resumes from the previous pair, never from an actor and a critic of different steps."""

    policy_backend: Any
    critic_backend: Any = None
    save_hf: bool = False
    tokenizer: Any = None

    def save(self, root: str, tag: str, client: dict, max_keep: int) -> None:
        if self.critic_backend is not None:
            self.critic_backend.save_checkpoint(os.path.join(root, "critic"), tag, client, max_keep + 1)
        self.policy_backend.save_checkpoint(os.path.join(root, "actor"), tag, client, max_keep)
        if self.save_hf:
            self.policy_backend.save_hf(os.path.join(root, f"{tag}_hf"), self.tokenizer)

    def load(self, root: str) -> dict | None:
        actor, critic = os.path.join(root, "actor"), os.path.join(root, "critic")
        if self.critic_backend is None:
            return self.policy_backend.load_checkpoint(actor)
        from rlhfkit.backend.checkpoint import list_checkpoints

        critic_tags = {t for _, t in list_checkpoints(critic)}
        pairs = [t for _, t in list_checkpoints(actor) if t in critic_tags]
        if not pairs:
            if list_checkpoints(actor) or critic_tags:
                raise FileNotFoundError(f"--load_checkpoint: no step has a complete checkpoint in both {actor} "
                                        f"and {critic}")
            return self.policy_backend.load_checkpoint(actor)  # none at all (or only incomplete: an error)
        client = self.policy_backend.load_checkpoint(actor, pairs[-1])
        self.critic_backend.load_checkpoint(critic, pairs[-1])
        return client
