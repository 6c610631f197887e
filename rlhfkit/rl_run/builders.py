"""Resolved flags -> RL components for the RL composition root (rlhfkit.rl_run.root; train_ppo and
train_ppo_ray): roles, engine, executors, loop configs.

The flags come checked and completed from `rlhfkit.rl_run.resolve` (a read-only `ResolvedFlags`). This is
the one place where the loop's components read the RL commands' namespace; everything it builds takes its
own config object.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from typing import Any

import torch

from rlhfkit.agents.base import AgentConfig
from rlhfkit.algo.advantages import AdvantageConfig
from rlhfkit.algo.experience import RewardShapingConfig
from rlhfkit.algo.kl import make_kl_controller
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.base import CheckpointingBackend
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.parallel.mesh import ParallelDims
from rlhfkit.cli.common import parallel_dims, report_dropped
from rlhfkit.trainers.rl_checkpoint import RLCheckpointer
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig, from_args
from rlhfkit.config.notes import note_once
from rlhfkit.config.rl_flags import EMA_BETA, PTX_COEF, RAY_ONLY
from rlhfkit.losses.policy import PolicyLossConfig
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.roles.actor import ActorRole, UpdateConfig
from rlhfkit.roles.critic import CriticRole, RewardModelRole
from rlhfkit.roles.memory import RoleOutOfMemory, advice
from rlhfkit.trainers.rl import RLLoopConfig
from rlhfkit.trainers.run_settings import allowed_changes, run_settings
from rlhfkit.types import SamplingParams

log = logging.getLogger(__name__)


def reward_server_urls(args: argparse.Namespace) -> list[str]:
    """The reward server URLs of --remote_rm_url (none for a reward_func file or a Python callable)."""
    if not isinstance(args.remote_rm_url, str):
        return []
    return [u.strip() for u in args.remote_rm_url.split(",") if u.strip().startswith(("http://", "https://"))]


def ptx_active(args: argparse.Namespace) -> bool:
    return bool(args.pretrain_data) and (args.ptx_coef if args.ptx_coef is not None else PTX_COEF) > 0


def best_metric_key(args: argparse.Namespace) -> str | None:
    """The eval metric that picks the best checkpoint ("" = the first `*_pass1` one), or None: off
    ("none", no evaluation, or the automatic key while --save_steps writes no checkpoints)."""
    key = args.best_metric_key
    if key.lower() == "none":
        return None
    if not (args.eval_dataset and args.eval_steps > 0):
        if key:
            note_once(f"note: --best_metric_key {key} has no effect without evaluation "
                      "(--eval_dataset and --eval_steps > 0)")
        return None
    return key if key or args.save_steps > 0 else None


def note_ray_only_flags(args: argparse.Namespace, parser: Any, prog: str) -> None:
    """One line naming the placement/engine flags that only train_ppo_ray uses."""
    set_flags = [d for d in RAY_ONLY if getattr(args, d) != parser.get_default(d)]
    if set_flags:
        names = ", ".join("--" + d for d in set_flags)
        log.info(f"note: {prog} runs in one process per rank; {names} take effect in train_ppo_ray only")


def actor_update_cfg(args: argparse.Namespace) -> UpdateConfig:
    return UpdateConfig(train_batch_size=args.train_batch_size, micro_train_batch_size=args.micro_train_batch_size,
                        max_epochs=args.max_epochs, seed=args.seed, temperature=args.temperature,
                        use_kl_loss=args.use_kl_loss, kl_estimator=args.kl_estimator,
                        max_tokens_per_micro=args.train_max_tokens_per_gpu if args.use_dynamic_batch else None,
                        packing=args.packing_samples, aux_loss_coef=args.aux_loss_coef,
                        ptx_coef=args.ptx_coef if ptx_active(args) else 0.0)


def rollout_max_tokens(args: argparse.Namespace) -> int | None:
    """Token budget of the experience-making micro-batches under --use_dynamic_batch."""
    if not args.use_dynamic_batch:
        return None
    return args.rollout_max_tokens_per_gpu or args.train_max_tokens_per_gpu


def explain_oom(args: argparse.Namespace, err: RoleOutOfMemory) -> RoleOutOfMemory:
    """`err` with the flags to change for its phase (one line for the user)."""
    err.hint = advice(err, dynamic_batch=args.use_dynamic_batch, train_tokens=args.train_max_tokens_per_gpu,
                      rollout_tokens=rollout_max_tokens(args) or 0, micro_train=args.micro_train_batch_size,
                      micro_rollout=args.micro_rollout_batch_size, checkpointing=args.gradient_checkpointing,
                      engine_awake_in_training=bool(getattr(args, "colocate_all_models", True))
                      and not args.vllm_enable_sleep)
    return err


def optimizer_steps(args: argparse.Namespace, num_prompts: int) -> int:
    """The policy's optimizer steps in the run (the LR schedule's length). --max_steps counts RL steps
    (a rollout and its update); when one makes several optimizer steps, one line says how many."""
    steps = args.max_steps if args.max_steps else (num_prompts // args.rollout_batch_size) * args.num_episodes
    per_step = -(-args.rollout_batch_size * args.n_samples_per_prompt // args.train_batch_size) * args.max_epochs
    if args.max_steps and per_step > 1:
        note_once(f"note: --max_steps {args.max_steps} counts RL steps; each makes {per_step} optimizer steps "
                  f"(--rollout_batch_size {args.rollout_batch_size} x --n_samples_per_prompt "
                  f"{args.n_samples_per_prompt} / --train_batch_size {args.train_batch_size}, x --max_epochs "
                  f"{args.max_epochs}): {args.max_steps * per_step} in all")
    return max(1, steps * per_step)


def backend_cfg(args: argparse.Namespace, **over) -> BackendConfig:
    """The RL roles' backend settings: under --torch_compile the blocks compile for any sequence length
    at once (every step's lengths differ; a static first compile would be thrown away at step 2)."""
    return from_args(BackendConfig, args, compile_dynamic=True, **over)


def build_ptx(args: argparse.Namespace, dist: DistInfo, tokenizer: Any):
    """PPO-ptx batches of this policy rank (`rlhfkit.data.ptx`): --pretrain_data as raw text of
    --input_key (loss on every token), cut to --max_len; None without --pretrain_data. `tokenizer`:
    the run's (`root.RLPlan.tokenizer`)."""
    if not ptx_active(args):
        return None
    from rlhfkit.data.io import DataError, load_mixture
    from rlhfkit.data.ptx import PtxBatches
    from rlhfkit.data.sft import SFTDataConfig, SFTDataset
    if tokenizer is None:
        raise ValueError("build_ptx: --pretrain_data is tokenized with the run's tokenizer; none was given")
    rows = load_mixture(args.pretrain_data, args.pretrain_data_probs, split=args.pretrain_split,
                        max_samples=args.max_samples, seed=args.seed, max_row_bytes=args.max_row_bytes)
    ds = SFTDataset(rows, tokenizer, SFTDataConfig(input_key=args.input_key, pretrain_mode=True, max_len=args.max_len))
    report_dropped(ds, len(rows), f"--pretrain_data {args.pretrain_data}", training=True)
    if not ds.items:
        raise DataError(f"--pretrain_data {args.pretrain_data}: no usable text in --input_key {args.input_key}")
    return PtxBatches(ds.items, args.micro_train_batch_size, tokenizer.pad_token_id, dist.dp_rank, dist.dp_size,
                      args.seed)


def build_policy(args: argparse.Namespace, dist: DistInfo, num_steps: int,
                 dims: ParallelDims | None = None, tokenizer: Any = None,
                 module: torch.nn.Module | None = None) -> tuple[ActorRole, FSDP2Backend]:
    """This rank's policy role and its backend (wrapped in a group and a handle by the placement);
    `tokenizer`: the run's (PPO-ptx data); `module`: the policy
    given in memory, trained itself (else --pretrain is loaded)."""
    from rlhfkit.models.loader import adopt_causal_lm, load_causal_lm

    cfg = from_args(ModelConfig, args)
    model = (adopt_causal_lm(module, cfg) if module is not None
             else load_causal_lm(cfg, master_dtype="fp32", defer_weights=True))
    optim = from_args(OptimConfig, args, learning_rate=args.actor_learning_rate)
    ema = (args.ema_beta if args.ema_beta is not None else EMA_BETA) if args.enable_ema else None
    bcfg = backend_cfg(args, ema_decay=ema)
    backend = FSDP2Backend(model, bcfg, optim, num_steps, dist, parallel=dims or parallel_dims(args, dist))
    loss_cfg = PolicyLossConfig.from_flags(
        policy_loss_type=args.policy_loss_type, eps_clip=args.eps_clip, eps_clip_low_high=args.eps_clip_low_high,
        dual_clip=args.dual_clip, enable_vllm_is_correction=args.enable_vllm_is_correction,
        vllm_is_correction_type=args.vllm_is_correction_type,
        vllm_is_truncated_threshold=args.vllm_is_truncated_threshold, entropy_loss_coef=args.entropy_loss_coef)
    role = ActorRole(backend, dist, loss_cfg, actor_update_cfg(args), args.micro_rollout_batch_size,
                     rollout_max_tokens(args), args.packing_samples, ptx=build_ptx(args, dist, tokenizer))
    return role, backend


def roles_in_run(args: argparse.Namespace) -> tuple[str, ...]:
    """The roles a run has, decided here only (the placements build these and no others): the policy; the
    reference with a KL term; the critic for GAE; a reward model when no reward function or agent gives the
    reward. (A local LoRA policy on its own base is its reference, adapters off: `ref_is_policy_base`.)"""
    roles = ["policy"]
    if args.init_kl_coef > 0:
        roles.append("ref")
    if args.advantage_estimator == "gae":
        roles.append("critic")
    if args.reward_pretrain and not (args.remote_rm_url or args.agent_func_path):
        roles.append("reward")
    return tuple(roles)


def ref_is_policy_base(args: argparse.Namespace, given: GivenModels = NONE) -> bool:
    """LoRA with the reference being the policy's own base model: the policy with its adapters switched
    off *is* the reference, so no second copy of the base model is loaded."""
    return getattr(args, "lora_rank", 0) > 0 and given.ref is None and args.ref_pretrain in (None, args.pretrain)


def given_reference(args: argparse.Namespace, given: GivenModels) -> torch.nn.Module | None:
    """For a run that has a reference: the module the models given in memory make it (None: the reference is
    loaded from its directory): the given `ref`, else a frozen copy of the policy's weights as they are now,
    before its first step; taken before the policy is built (LoRA changes the module in place). No copy under LoRA
    on the policy's own base (the policy with its adapters off is the reference)."""
    if given.ref is not None:
        return given.ref
    if given.policy is None or args.ref_pretrain or ref_is_policy_base(args, given):
        return None
    from rlhfkit.models.given import frozen_copy

    return frozen_copy(given.policy)


def build_ref(args: argparse.Namespace, dist: DistInfo, dims: ParallelDims | None = None,
              policy_backend: FSDP2Backend | None = None, module: torch.nn.Module | None = None,
              given: GivenModels = NONE) -> ActorRole:
    """The reference model's role (`roles_in_run` says whether the run has one). Given the policy's backend
    (one process or torchrun) and LoRA on the same base, the reference runs the policy with its adapters off.
    `module`: the reference in memory (`given_reference`), else --ref_pretrain (default --pretrain) is loaded."""
    if policy_backend is not None and ref_is_policy_base(args, given):
        note_once("note: reference model = the policy with its LoRA adapters switched off (no second copy of "
                  "the base model)" + ("; --ref_offload has no effect: there are no separate reference weights"
                                       if args.ref_offload else ""))
        role = ActorRole(policy_backend, dist, micro_rollout_batch_size=args.micro_rollout_batch_size,
                         rollout_max_tokens=rollout_max_tokens(args), packing=args.packing_samples,
                         adapters_off=True)
        return role
    from rlhfkit.models.loader import load_causal_lm

    cfg = from_args(ModelConfig, args, lora_rank=0, gradient_checkpointing=False)
    model = module if module is not None else load_causal_lm(cfg, path=args.ref_pretrain or args.pretrain,
                                                             flag="--ref_pretrain", defer_weights=True)
    backend = FSDP2Backend(model, backend_cfg(args), None, 0, dist, parallel=dims or parallel_dims(args, dist))
    role = ActorRole(backend, dist, micro_rollout_batch_size=args.micro_rollout_batch_size,
                     rollout_max_tokens=rollout_max_tokens(args), packing=args.packing_samples,
                     offload=args.ref_offload)
    return role


def critic_path(args: argparse.Namespace, given: GivenModels = NONE) -> str | torch.nn.Module:
    """What the critic starts from: --critic_pretrain, else the first --reward_pretrain, else the policy
    (its directory, or the module given in memory)."""
    if args.critic_pretrain:
        return args.critic_pretrain
    if args.reward_pretrain:
        return args.reward_pretrain.split(",")[0]
    return given.policy_or_path(args.pretrain)


def given_critic_base(args: argparse.Namespace, given: GivenModels) -> torch.nn.Module | None:
    """A copy of the policy given in memory for the critic to start from (GAE with neither --critic_pretrain
    nor --reward_pretrain), taken before the policy is built; None where the critic is loaded."""
    if not isinstance(critic_path(args, given), torch.nn.Module):
        return None
    from rlhfkit.models.given import frozen_copy

    return frozen_copy(critic_path(args, given))  # type: ignore[arg-type]


def build_critic(args: argparse.Namespace, dist: DistInfo, num_steps: int, dims: ParallelDims | None = None,
                 base: torch.nn.Module | None = None) -> tuple[CriticRole, FSDP2Backend]:
    """The critic's role and backend (`roles_in_run`: GAE); `base`: the policy's copy it starts from
    (`given_critic_base`), else `critic_path` is loaded."""
    from rlhfkit.models.value import checkpoint_keys, load_value_model, value_model_from

    if base is not None:
        model = value_model_from(base, args.value_head_prefix, from_args(ModelConfig, args))
    else:
        path = str(critic_path(args))
        fresh = f"{args.value_head_prefix}.weight" not in checkpoint_keys(path)
        model = load_value_model(path, args.value_head_prefix, init_value_head=fresh, dtype=torch.float32,
                                 normalize_reward=False, cfg=from_args(ModelConfig, args, pretrain=path),
                                 flag="--critic_pretrain")
    optim = from_args(OptimConfig, args, learning_rate=args.critic_learning_rate, **critic_optim(args))
    backend = FSDP2Backend(model, backend_cfg(args), optim, num_steps, dist, parallel=dims or parallel_dims(args, dist))
    upd = replace(actor_update_cfg(args), aux_loss_coef=0.0, ptx_coef=0.0)
    if args.aux_loss_coef:
        note_once("note: --aux_loss_coef has no effect on the critic: a value model returns no router loss")
    role = CriticRole(backend, dist, upd, args.value_clip, args.micro_rollout_batch_size, rollout_max_tokens(args))
    return role, backend


def critic_optim(args: argparse.Namespace) -> dict[str, Any]:
    """OptimConfig fields of the critic: --critic.* (an unset one is the actor's), --critic.optim / muon."""
    def own(critic: Any, actor: Any) -> Any:
        return actor if critic is None else critic

    return {"adam_betas": own(args.critic_adam_betas, args.adam_betas),
            "adam_eps": own(args.critic_adam_eps, args.adam_eps), "l2": own(args.critic_l2, args.l2), "lr_scheduler": own(args.critic_lr_scheduler, args.lr_scheduler),
            "lr_warmup_ratio": own(args.critic_lr_warmup_ratio, args.lr_warmup_ratio),
            "min_lr_ratio": own(args.critic_min_lr_ratio, args.min_lr_ratio),
            "max_norm": own(args.critic_max_norm, args.max_norm), "optim": args.critic_optim,
            "master_weights": args.critic_master_weights,
            "muon_lr": args.critic_muon_lr, "muon_momentum": args.critic_muon_momentum,
            "muon_ns_steps": args.critic_muon_ns_steps, "muon_nesterov": args.critic_muon_nesterov}


def build_reward_model(args: argparse.Namespace, dist: DistInfo) -> RewardModelRole:
    """The reward models of --reward_pretrain (comma-separated: summed) as one role (`roles_in_run`)."""
    from rlhfkit.models.loader import resolve_dtype
    from rlhfkit.models.value import load_value_model

    dtype = resolve_dtype(args.param_dtype) if dist.device.startswith("cuda") else torch.float32
    models = [load_value_model(p, args.value_head_prefix, dtype=dtype, normalize_reward=args.normalize_reward,
                               attn_implementation=args.attn_implementation, device=dist.device,
                               flag="--reward_pretrain")
              for p in args.reward_pretrain.split(",") if p]
    return RewardModelRole(models, dist, args.micro_rollout_batch_size, offload=args.reward_offload)


def engine_max_num_seqs(args: argparse.Namespace, num_engines: int) -> int:
    """Sequences one engine decodes at once: --rollout_max_num_seqs, else its share of a step's samples (<= 512)."""
    per_rank = args.rollout_batch_size // num_engines * args.n_samples_per_prompt
    return args.rollout_max_num_seqs or min(per_rank, 512)


def build_engine_for(args: argparse.Namespace, tokenizer: Any, dist: DistInfo, tp: Any = None,
                     share_with: torch.nn.Module | None = None, given: torch.nn.Module | None = None):
    """The rollout engine of --rollout_engine; `share_with`: the policy module whose weights the builtin
    engine serves itself (`engine_sharing`), instead of loading its own copy from --pretrain; `given`: the
    policy given in memory, which an engine of its own copies instead of --pretrain."""
    from rlhfkit.rollout import build_engine

    from rlhfkit.config.dtypes import run_dtype

    dtype = run_dtype(args.param_dtype, dist.device)
    seqs = engine_max_num_seqs(args, dist.dp_size)  # each dp rank (or Ray engine) samples its share
    opts: dict[str, Any] = {}
    if args.rollout_engine == "builtin":
        opts = {"max_model_len": args.max_len, "max_num_seqs": seqs, "compile": args.rollout_compile}
    elif args.rollout_engine == "hf":
        opts = {"max_batch_size": seqs}
    if share_with is not None:  # the eos ids the engine reads from --pretrain's generation config otherwise
        eos = pretrain_eos_ids(given if given is not None else args.pretrain, tokenizer)
        return build_engine(args.rollout_engine, share_with, tokenizer, device=dist.device, dtype=dtype, tp=tp,
                            share_weights=True, eos_token_ids=eos, **opts)
    if given is not None:
        opts["eos_token_ids"] = pretrain_eos_ids(given, tokenizer)
    return build_engine(args.rollout_engine, given if given is not None else args.pretrain, tokenizer,
                        device=dist.device, dtype=dtype, tp=tp, **opts)


def pretrain_eos_ids(path: str | torch.nn.Module, tokenizer: Any) -> list[int]:
    """The eos ids of a model directory's (or a module's) generation config and its tokenizer (what an engine
    loaded from `path` stops at)."""
    from transformers import GenerationConfig

    from rlhfkit.models.hub import resolve_model_path
    from rlhfkit.rollout.engine_utils import eos_ids_of

    if isinstance(path, torch.nn.Module):
        return eos_ids_of(path.generation_config if hasattr(path, "generation_config") else None, tokenizer)
    try:
        gen = GenerationConfig.from_pretrained(resolve_model_path(path, "--pretrain"))
    except (OSError, ValueError):
        gen = None
    return eos_ids_of(gen, tokenizer)


def flags_block_sharing(args: argparse.Namespace, world_size: int) -> str | None:
    """What in the flags keeps train_ppo's builtin engine from serving the policy's own weights, None if
    nothing does (`engine_sharing` then looks at the built policy; the memory plan reads this)."""
    if args.engine_weights == "copy":
        return "--engine_weights copy"
    if args.rollout_engine != "builtin":
        return f"--rollout_engine {args.rollout_engine} loads its own copy"
    if world_size > 1:
        return f"the policy is split over {world_size} ranks"
    if args.adam_offload and str(args.device or "cuda").startswith("cuda"):
        return "--adam_offload keeps the policy's weights sharded in host memory"
    return None


def engine_sharing(args: argparse.Namespace, dist: DistInfo, backend: FSDP2Backend) -> str | None:
    """Why train_ppo's builtin engine cannot serve the policy's own weights (--engine_weights), None where it
    can: it then holds no copy of its own and a weight sync copies nothing of what it shares."""
    from rlhfkit.config.dtypes import run_dtype
    from rlhfkit.rollout.builtin.model.shared_weights import sharing_blocker

    why = flags_block_sharing(args, dist.world_size)
    if why is not None:
        return why
    if backend.is_sharded:
        return "the policy's weights are sharded"
    return sharing_blocker(backend.unwrap(), run_dtype(args.param_dtype, dist.device))


def close_rollout(engine: Any, user_code_grace_s: float = 5.0) -> None:
    """End the engine's worker thread and the threads running user code (reward_func, agents),
    success or failure: a daemon thread still inside torch when the interpreter exits aborts it
    ("terminate called without an active exception")."""
    from rlhfkit.usercode.run import shutdown_user_threads

    from rlhfkit.rollout.base import ClosableEngine

    if isinstance(engine, ClosableEngine):
        try:
            engine.close()
        except Exception as e:  # noqa: BLE001 - must not hide the error that ended the run
            log.info(f"note: closing the rollout engine failed: {type(e).__name__}: {e}")
    stuck = shutdown_user_threads(user_code_grace_s)
    if stuck:
        log.info(f"note: {stuck} reward_func / agent call(s) still running after {user_code_grace_s:g} s were "
                 "abandoned")


def agent_config(args: argparse.Namespace, temperature: float) -> AgentConfig:
    sp = SamplingParams(temperature=temperature, top_p=args.top_p, top_k=args.top_k,
                        max_new_tokens=args.generate_max_len, seed=args.seed)
    return AgentConfig(max_length=args.max_len, sampling_params=sp, step_timeout_s=args.reward_timeout,
                       reward_timeout_s=args.reward_timeout, reward_failure=args.reward_failure)


def build_executor(args: argparse.Namespace, engine: Any, tokenizer: Any, temperature: float, vision: Any = None):
    from rlhfkit.agents.executors import SingleTurnAgentExecutor
    from rlhfkit.agents.loader import build_agent_executor
    from rlhfkit.rewards.process_pool import reward_source_with_workers

    cfg = replace(agent_config(args, temperature), vision=vision)  # a VLM's picture handling (or None)
    workers = args.reward_workers
    if args.agent_func_path:
        if workers:
            note_once("note: --reward_workers has no effect with --agent_func_path (agent environments run in "
                      "threads of the trainer)")
        return build_agent_executor(args.agent_func_path, engine, tokenizer, cfg)
    if workers and not args.remote_rm_url:
        note_once("note: --reward_workers has no effect without a --remote_rm_url reward_func file")
    source = (reward_source_with_workers(args.remote_rm_url, args.reward_timeout, workers)
              if args.remote_rm_url else None)
    return SingleTurnAgentExecutor().setup(engine, tokenizer, cfg, reward_source=source)


def loop_config(args: argparse.Namespace, vision: Any = None, dropped_image_rows: int = 0) -> RLLoopConfig:
    """The loop's settings; `vision` (a VLM's context) keeps its picture tokens out of the loss, and rows
    dropped for a bad picture are logged with every step."""
    return RLLoopConfig(
        no_loss_token_ids=vision.layout.special_ids if vision is not None else (),
        data_metrics={"data/dropped_image_rows": float(dropped_image_rows)} if vision is not None else {},
        rollout_batch_size=args.rollout_batch_size, n_samples_per_prompt=args.n_samples_per_prompt,
        num_episodes=args.num_episodes, max_steps=args.max_steps, seed=args.seed, temperature=args.temperature,
        init_kl_coef=args.init_kl_coef, kl_estimator=args.kl_estimator, use_kl_loss=args.use_kl_loss,
        dynamic_filtering=args.dynamic_filtering,
        dynamic_filtering_reward_range=tuple(args.dynamic_filtering_reward_range),
        max_filter_rounds=args.max_filter_rounds,
        freezing_actor_steps=args.freezing_actor_steps, logging_steps=args.logging_steps,
        log_completions_steps=args.log_completions_steps, log_completions_rows=args.log_completions_rows,
        eval_steps=args.eval_steps, eval_temperature=args.eval_temperature,
        eval_n_samples_per_prompt=args.eval_n_samples_per_prompt, save_steps=args.save_steps,
        ckpt_path=args.ckpt_path, max_ckpt_num=args.max_ckpt_num, load_checkpoint=args.load_checkpoint,
        show_progress=not args.disable_progress, max_failed_steps=args.max_failed_steps,
        failure_source="the reward server" if reward_server_urls(args) else "user code",
        skip_zero_advantage_steps=not ptx_active(args),  # the ptx loss moves the policy even then
        policy_max_epochs=args.max_epochs, policy_train_batch_size=args.train_batch_size,
        recompute_old_logprobs=args.recompute_old_logprobs, run_settings=run_settings(vars(args)),
        allowed_changes=allowed_changes(args.allow_resume_changes))


def advantage_config(args: argparse.Namespace) -> AdvantageConfig:
    return from_args(AdvantageConfig, args, reward_clip_range=tuple(args.reward_clip_range))


def shaping_config(args: argparse.Namespace) -> RewardShapingConfig:
    return from_args(RewardShapingConfig, args)


def kl_controller(args: argparse.Namespace):
    return make_kl_controller(args.init_kl_coef, args.kl_target, args.kl_horizon)


def checkpointer(args: argparse.Namespace, policy_backend: CheckpointingBackend,
                 critic_backend: CheckpointingBackend | None, tokenizer: Any, dist: DistInfo) -> RLCheckpointer:
    from rlhfkit.config.flags import run_dir_of

    return RLCheckpointer(policy_backend, critic_backend, args.save_hf_ckpt, tokenizer,
                          save_ds=not args.disable_ds_ckpt, best_metric_key=best_metric_key(args),
                          run_dir=run_dir_of(args), dist=dist)
