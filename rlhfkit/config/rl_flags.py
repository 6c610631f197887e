"""Flags of the RL commands (train_ppo, train_ppo_ray): OpenRLHF's flat names + dotted aliases, declared as the
fields of the RL component configs below (rlhfkit.config.declare), and `add_rl_flags`, their table.

Defaults follow OpenRLHF where a user would expect them (see the shared reference, section 2.1).
Placement and engine flags (`--*_num_nodes`, `--vllm_*`, `--colocate_*`, `--*_enable_sleep`) are
declared here for both commands; `train_ppo` (one process / torchrun) reports them as not taking
effect instead of dropping them silently. Help groups: the shared ones of rlhfkit.config.flags,
then the RL_* groups below.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from rlhfkit.config.configs import InputsConfig, LRSchedule, OptimFlags
from rlhfkit.config.declare import Switch, add_fields, declared_default, declared_help, flag, flag_fields
from rlhfkit.config.flag_parser import (RL_ALGO, RL_ASYNC, RL_CRITIC, RL_MODELS, RL_PLACEMENT, RL_PTX, RL_REWARD,
                                        RL_ROLLOUT)
from rlhfkit.config.flags import (CKPT, DATA, EVAL, LOGGING, OPTIM, ROLLOUT_ENGINE_HELP, TRAIN,
                                  FlagParser, add_adam_flags, add_backend_flags, add_batch_flags, add_ckpt_flags,
                                  add_dataloader_workers_flag, add_eval_data_flags, add_full_determinism_flag,
                                  add_image_flags, add_input_key_flag, add_label_key_flag, add_logging_flags,
                                  add_max_len_flag, add_max_new_tokens_flag, add_max_row_bytes_flag,
                                  add_max_samples_flag, add_max_steps_flag, add_model_flags, add_nonfinite_flag,
                                  add_normalize_reward_flag, add_optimizer_choice_flags, add_prefix_caching_flag,
                                  add_prompt_max_len_flag, add_ref_model_flags, add_reward_model_flag,
                                  add_rollout_batch_flag, add_rollout_engine_flag, add_schedule_flags, add_seed_flag,
                                  add_temperature_flag, add_template_flags, add_top_p_flag,
                                  add_value_head_flag)
from rlhfkit.weightsync.flags import DEFAULT_BUCKET_MB
from rlhfkit.weightsync.flags import Method as WeightSyncMethod



# `rlhfkit grpo` and `rlhfkit rloo`: train_ppo with the defaults of TRL's GRPOConfig and RLOOConfig, as
# train_ppo's flags (the Python API's GRPOConfig / RLOOConfig keep OpenRLHF's recipes, rlhfkit.api.rl). TRL batches by
# completions: per_device_train_batch_size 8 completions per optimizer step, generated once per step, so
# 8 / num_generations prompts a step. beta is TRL's KL weight: GRPO's a k3 loss term, RLOO's in the reward
# (k1); 0 loads no reference model. TRL's learning rate (1e-6), clip epsilon (0.2) and temperature (1.0)
# are train_ppo's defaults already.
PRESETS: dict[str, dict[str, object]] = {
    "grpo": {"advantage_estimator": "group_norm", "n_samples_per_prompt": 8, "rollout_batch_size": 1,
             "train_batch_size": 8, "micro_train_batch_size": 8, "generate_max_len": 512, "init_kl_coef": 0.0,
             "use_kl_loss": True, "kl_estimator": "k3", "num_episodes": 3, "lr_scheduler": "linear",
             "lr_warmup_ratio": 0.0, "logging_steps": 10, "input_key": "prompt"},
    "rloo": {"advantage_estimator": "rloo", "n_samples_per_prompt": 2, "rollout_batch_size": 4,
             "train_batch_size": 8, "micro_train_batch_size": 8, "generate_max_len": 256, "init_kl_coef": 0.05,
             "num_episodes": 3, "lr_scheduler": "linear", "lr_warmup_ratio": 0.0, "logging_steps": 10,
             "input_key": "prompt"},
}
# TRL's names of train_ppo's flags, accepted by `rlhfkit grpo` / `rlhfkit rloo` (flag -> TRL's spellings)
TRL_FLAG_NAMES = {"--pretrain": ("--model_name_or_path",), "--save_path": ("--output_dir",),
                  "--remote_rm_url": ("--reward_funcs",), "--prompt_data": ("--dataset", "--dataset_name"),
                  "--prompt_split": ("--dataset_train_split",), "--actor_learning_rate": ("--learning_rate",),
                  "--n_samples_per_prompt": ("--num_generations",),
                  "--generate_max_len": ("--max_completion_length",),
                  "--micro_train_batch_size": ("--per_device_train_batch_size",),
                  "--num_episodes": ("--num_train_epochs",), "--init_kl_coef": ("--beta",),
                  "--eps_clip": ("--epsilon",), "--clip_eps_high": ("--epsilon_high",),
                  "--lr_scheduler": ("--lr_scheduler_type",), "--lr_warmup_ratio": ("--warmup_ratio",),
                  "--max_norm": ("--max_grad_norm",)}


def apply_preset(p: FlagParser, name: str) -> None:
    """Make PRESETS[name] the defaults of `p` (train_ppo's flags; --help shows them) and accept TRL's names."""
    p.set_defaults(**PRESETS[name])
    for option, names in TRL_FLAG_NAMES.items():
        p.alias(option, *names)
EMA_BETA = 0.992  # --ema_beta when not given (OpenRLHF's default)
PTX_COEF = 0.05  # --ptx_coef when not given (OpenRLHF's default)
ROLES = ["actor", "ref", "critic", "reward"]
Estimator = Literal["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "grpo", "dr_grpo"]
ESTIMATORS = list(typing.get_args(Estimator))  # grpo: group_norm


@dataclass
class RLModelFlags:
    """The critic and where the reference and reward models live between passes (the models themselves:
    rlhfkit.config.configs' RewardModelFlags and RefModelFlags)."""

    critic_pretrain: str | None = flag(
        None, "--critic.model_name_or_path", group=RL_MODELS,
        help="initial critic (value model; directory or hub id) for --advantage_estimator gae (default: "
             "--reward_pretrain, else --pretrain)")
    ref_reward_offload: bool = flag(False, help="both --ref_offload and --reward_offload")
    reward_offload: bool = flag(False, "--reward.offload",
                                help="keep the reward model(s) in host memory between their forward passes")


@dataclass
class CompletionLogFlags:
    """The table of sampled completions an RL run logs."""

    log_completions_steps: int = flag(
        10, group=LOGGING,
        help="every N RL steps (and at step 1) log a table of sampled prompts, completions, rewards and labels: "
             "completions.jsonl in the run directory, TensorBoard text, a wandb table, and its first rows on the "
             "console (0: off)")
    log_completions_rows: int = flag(
        8, help="samples in each --log_completions_steps table, taken from as many prompts as possible")


@dataclass
class BestCheckpointFlags:
    best_metric_key: str = flag(
        "", "--ckpt.best_metric_key", group=CKPT,
        help="eval metric that picks the best checkpoint ('': the first *_pass1 one; none: off)")


@dataclass
class RewardSourceFlags:
    """Where rewards come from (a reward server or reward_func file, an agent), how they are shaped, and
    what a failing reward call does."""

    agent_func_path: str | None = flag(
        None, "--train.agent_func_path", group=RL_REWARD,
        help="a .py file defining AgentExecutor (multi-turn) or AgentInstance (step() gives the reward)")
    reward_clip_range: list[float] = flag([-10.0, 10.0], "--reward.clip_range", nargs=2,
                                          help="LOW HIGH: clamp the scalar reward to this range before KL shaping")
    overlong_buffer_len: int | None = flag(
        None, "--reward.overlong_buffer_len",
        help="DAPO soft overlong penalty: responses within this many tokens of --generate_max_len lose reward "
             "linearly (default: off)")
    overlong_penalty_factor: float = flag(1.0, "--reward.overlong_penalty_factor",
                                          help="the largest overlong penalty (at --generate_max_len)")
    stop_properly_penalty_coef: float | None = flag(
        None, "--reward.stop_properly_penalty_coef",
        help="ProRL: a truncated response's reward is multiplied by c >= 0, or replaced by c < 0 (default: off)")
    reward_failure: Literal["stop", "drop"] = flag(
        "stop", help="what a reward_func / agent exception does: stop the run, or drop the sample (counted)")
    reward_timeout: float = flag(
        300.0,
        help="seconds for one reward_func / agent step call (a reward worker past it is killed); a reward server is "
             "retried within twice this")
    reward_workers: int | None = flag(
        None,
        help="worker processes that run a --remote_rm_url reward_func .py file (default: the CPU count, at most 4): "
             "a call past --reward_timeout is killed, and CPU-bound reward code runs beside the rollout engine. 0: "
             "threads of the trainer, where a call that never returns cannot be stopped")


@dataclass
class RolloutFlags:
    """The RL rollout beyond the sampling settings (rlhfkit.config.configs.SamplingFlags): the group size,
    experience-making batches and the builtin engine's options."""

    rollout_max_num_seqs: int | None = flag(
        None, group=RL_ROLLOUT,
        help="sequences the engine decodes at once (default: all samples of a step on this rank, at most 512)")
    engine_weights: Literal["auto", "shared", "copy"] = flag(
        "auto",
        help="train_ppo in one process: the builtin engine serves the policy's own weights (shared: one copy on the "
             "device, nothing copied per step) or holds a copy of its own (copy); auto: shared where possible (one "
             "rank, weights in the engine's dtype; a LoRA policy's adapters are applied unmerged), one line says "
             "which; train_ppo_ray's engines always hold their own")
    rollout_compile: bool = flag(
        False,
        help="torch.compile the builtin engine's decode step (GPU): fewer, fused kernels per step, for long runs; "
             "its compilation adds 20-30 s to the first step (a few seconds with the cache a previous run left, "
             "docs/performance.md); off: eager kernels replayed as CUDA graphs")
    n_samples_per_prompt: int = flag(1, "--rollout.n_samples_per_prompt",
                                     help="samples generated per prompt (the group of GRPO / RLOO)")
    micro_rollout_batch_size: int = flag(
        8, "--rollout.micro_batch_size",
        help="samples per forward pass when computing log-probs, values and rewards of a rollout")
    top_k: int = flag(-1, "--rollout.top_k", help="sample from the k likeliest tokens (-1: all)")
    rollout_max_tokens_per_gpu: int | None = flag(
        None, "--rollout.max_tokens_per_gpu",
        help="--use_dynamic_batch: tokens per forward pass of experience making (default: --train_max_tokens_per_gpu)")
    vllm_generate_batch_size: int | None = flag(
        None, "--rollout.vllm_generate_batch_size", help="OpenRLHF: prompts generated per round (over-sampling)",
        inert="each step generates --rollout_batch_size prompts (dynamic filtering draws more as needed)")


@dataclass
class PromptDataFlags:
    """The RL prompts (--prompt_data itself: rlhfkit.config.configs.InputsConfig), the PPO-ptx pretraining text
    (the policy loss plus --ptx_coef x its NLL) and evaluation."""

    prompt_data_probs: str | None = flag(None, "--data.prompt_probs", group=DATA,
                                         help="comma-separated sampling probabilities, one per --prompt_data entry")
    prompt_split: str = flag("train", "--data.prompt_split", help="split of --prompt_data to read")
    pretrain_data: str | None = flag(
        None, group=RL_PTX,
        help="text for the PPO-ptx loss: files, folders or dataset names, comma-separated (text in --input_key)")
    pretrain_data_probs: str | None = flag(None, help="sampling probabilities of --pretrain_data")
    pretrain_split: str = flag("train", help="split of --pretrain_data to read")
    ptx_coef: float | None = flag(None, help=f"weight of the PPO-ptx loss (with --pretrain_data; default {PTX_COEF})")
    eval_temperature: float = flag(0.6, "--eval.temperature", group=EVAL, help="sampling temperature of evaluation")
    eval_n_samples_per_prompt: int = flag(
        4, "--eval.n_samples_per_prompt",
        help="samples per evaluation prompt (pass@1 averages them, pass@n takes the best)")
    eval_max_samples: int | None = flag(None, help="evaluate on at most this many prompts")


@dataclass
class RLTrainFlags:
    """How the RL loop trains: epochs over a rollout, episodes, dynamic batches, the critic warm-up, EMA,
    learning rates of the two models, async training."""

    recompute_old_logprobs: bool = flag(
        False, group=TRAIN,
        help="run the old policy's log-prob pass even when a rollout makes one optimizer step (by default the "
             "training pass's detached log-probs are the old ones then, ratio 1, as in TRL's GRPO)")
    num_episodes: int = flag(1, "--train.num_episodes", help="passes over the prompts")
    use_dynamic_batch: bool = flag(
        False, "--train.dynamic_batch_enable",
        help="micro-batches by token budget (--train_max_tokens_per_gpu) instead of sample count")
    train_max_tokens_per_gpu: int = flag(16192, "--train.max_tokens_per_gpu",
                                         help="--use_dynamic_batch: tokens per training micro-batch on each rank")
    freezing_actor_steps: int = flag(-1, "--critic.freezing_steps",
                                     help="train only the critic for the first N steps (critic warm-up; -1: off)")
    save_value_network: bool = flag(False, "--critic.save_value_network",
                                    help="also save the critic, to <save_path>_critic")
    enable_ema: bool = flag(False, "--train.enable_ema",
                            help="keep an exponential moving average of the policy's weights; it is what gets saved")
    ema_beta: float | None = flag(
        None, "--train.ema_beta",
        help=f"EMA decay (default {EMA_BETA}): ema = beta * ema + (1 - beta) * weights after every optimizer step")
    actor_init_on_gpu: bool = flag(
        False, help="OpenRLHF: build the actor directly on the GPU",
        inert="models are loaded on the host and moved (or sharded) onto the device by the backend")
    perf: bool = flag(False, help="OpenRLHF: log step timings",
                      inert="step timings are always logged (time/* in metrics.jsonl)")
    max_failed_steps: int = flag(
        3,
        help="steps in a row without a trajectory to train on (all samples dropped or filtered out) before the run "
             "stops; fewer are skipped and counted in skipped_steps")
    actor_learning_rate: float = flag(1e-6, "--actor.adam.lr", group=OPTIM, help="the policy's peak learning rate")
    critic_learning_rate: float = flag(9e-6, "--critic.adam.lr", help="the critic's peak learning rate")
    async_train: bool = flag(False, "--train.async_enable", group=RL_ASYNC,
                             help="generate the next rollouts while the policy trains (train_ppo_ray)")
    async_queue_size: int = flag(1, "--train.async_queue_size",
                                 help="rollouts generated ahead of the policy at most (bounds the off-policyness)")
    partial_rollout: bool = flag(
        False, "--train.partial_rollout_enable",
        help="with --async_train: load new weights between decode steps, generations in flight continue")


def _critics(name: str) -> str:
    return f"the critic's {declared_help(OptimFlags, name)}"


@dataclass
class CriticOptimFlags:
    """The critic's optimizer. Unset (None), the schedule and AdamW settings take the actor's value, so the
    flat OpenRLHF names (--adam_betas, --l2, --max_norm, ...) set both models as they did; the dotted
    --critic.* names set the critic's alone (rl_run.resolve)."""

    critic_adam_betas: list[float] | None = flag(None, "--critic.adam.betas", nargs=2, group=RL_CRITIC,
                                                 help="the critic's --adam_betas (default: the actor's)")
    critic_adam_eps: float | None = flag(None, "--critic.adam.eps",
                                         help="the critic's --adam_eps (default: the actor's)")
    critic_l2: float | None = flag(None, "--critic.adam.weight_decay", help="the critic's --l2 (default: the actor's)")
    critic_lr_scheduler: LRSchedule | None = flag(None, "--critic.lr_scheduler",
                                                  help="the critic's --lr_scheduler (default: the actor's)")
    critic_lr_warmup_ratio: float | None = flag(None, "--critic.lr_warmup_ratio",
                                                help="the critic's --lr_warmup_ratio (default: the actor's)")
    critic_min_lr_ratio: float | None = flag(None, "--critic.min_lr_ratio",
                                             help="the critic's --min_lr_ratio (default: the actor's)")
    critic_max_norm: float | None = flag(None, "--critic.max_norm",
                                         help="the critic's --max_norm (default: the actor's)")
    critic_optim: Literal["adam", "adamw_8bit", "muon"] = flag(
        declared_default(OptimFlags, "optim"), "--critic.optim", help=_critics("optim"))
    critic_master_weights: Literal["fp32", "bf16_stochastic", "bf16_kahan"] = flag(
        declared_default(OptimFlags, "master_weights"), "--critic.master_weights", help=_critics("master_weights"))
    critic_muon_lr: float = flag(declared_default(OptimFlags, "muon_lr"), "--critic.muon.lr",
                                 help="the critic's Muon learning rate (--critic_optim muon)")
    critic_muon_momentum: float = flag(declared_default(OptimFlags, "muon_momentum"), "--critic.muon.momentum",
                                       help=_critics("muon_momentum"))
    critic_muon_ns_steps: int = flag(declared_default(OptimFlags, "muon_ns_steps"), "--critic.muon.ns_steps",
                                     help=_critics("muon_ns_steps"))
    critic_muon_nesterov: bool = flag(
        declared_default(OptimFlags, "muon_nesterov"), "--critic.muon.nesterov", help=_critics("muon_nesterov"),
        switches=(Switch(("--critic_muon_no_nesterov", "--critic.muon.no_nesterov"), False,
                         "the critic's Muon: plain momentum"),))


# The critic's optimizer flags that default to the actor's: critic_<dest> -> the actor's dest
CRITIC_OPTIM = ("adam_betas", "adam_eps", "l2", "lr_scheduler", "lr_warmup_ratio", "min_lr_ratio", "max_norm")


@dataclass
class AlgoFlags:
    """The RL algorithm: advantage estimator, KL term, policy loss and its clipping, dynamic filtering and the
    importance-sampling correction of the engine's log-probs."""

    advantage_estimator: Estimator = flag(
        "gae", "--algo.advantage.estimator", group=RL_ALGO,
        help="gae (PPO with a critic), reinforce (REINFORCE++), reinforce_baseline (REINFORCE++-baseline), rloo, "
             "group_norm or grpo (GRPO), dr_grpo (Dr. GRPO); the group ones need --n_samples_per_prompt > 1")
    gamma: float = flag(1.0, "--algo.advantage.gamma", help="discount factor of the returns")
    lambd: float = flag(1.0, "--algo.advantage.lambd", help="GAE lambda (--advantage_estimator gae)")
    no_advantage_std_norm: bool = flag(
        False, "--algo.advantage.no_std_norm",
        help="normalise advantages by subtracting the mean only, without dividing by the std")
    init_kl_coef: float = flag(
        0.01, "--algo.kl.init_coef",
        help="weight of the KL penalty against the reference model (0: no reference model at all)")
    kl_target: float | None = flag(
        None, "--algo.kl.target",
        help="adaptive KL controller: move the KL coefficient towards this KL per sample (default: fixed coefficient)")
    kl_horizon: int = flag(10000, "--algo.kl.horizon",
                           help="adaptive KL controller: samples over which the coefficient adapts")
    kl_estimator: Literal["k1", "k2", "k3"] = flag(
        "k1", "--algo.kl.estimator",
        help="per-token KL estimator (Schulman's k1 = log ratio, k2 = squared log ratio / 2, k3 = ratio - 1 - log "
             "ratio)")
    use_kl_loss: bool = flag(False, "--algo.kl.use_loss",
                             help="KL as a loss term of the policy (GRPO) instead of a penalty in the reward")
    policy_loss_type: Literal["ppo", "gspo"] = flag(
        "ppo", "--actor.policy_loss_type", help="ppo: token-level clipped ratio; gspo: sequence-level ratio (GSPO)")
    eps_clip: float = flag(0.2, "--actor.eps_clip", help="PPO clip range: the ratio is clipped to [1 - eps, 1 + eps]")
    eps_clip_low_high: list[float] | None = flag(
        None, "--actor.eps_clip_low_high", nargs=2,
        help="asymmetric clip range LOW HIGH, [1 - low, 1 + high] (DAPO clip-higher; default: --eps_clip twice)")
    clip_eps_low: float | None = flag(None, help="alias: lower clip (sets --eps_clip_low_high[0])")
    clip_eps_high: float | None = flag(None, help="alias: upper clip (sets --eps_clip_low_high[1])")
    dual_clip: float | None = flag(None, "--actor.dual_clip",
                                   help="dual-clip PPO bound c > 1 for negative advantages (default: off)")
    value_clip: float = flag(0.5, "--critic.value_clip",
                             help="the critic's value clip: new values stay within this of the old ones in the loss")
    entropy_loss_coef: float | None = flag(None, "--actor.entropy_coef",
                                           help="weight of an entropy bonus in the policy loss (default: none)")
    dynamic_filtering: bool = flag(
        False, "--algo.dynamic_filtering_enable",
        help="DAPO dynamic sampling: drop prompt groups whose mean score lies outside "
             "--dynamic_filtering_reward_range and generate more")
    dynamic_filtering_reward_range: list[float] = flag(
        [0.0, 1.0], "--algo.dynamic_filtering_range", nargs=2,
        help="open interval LOW HIGH of group-mean scores kept by --dynamic_filtering")
    max_filter_rounds: int = flag(
        8,
        help="--dynamic_filtering: generation rounds per step at most (the first included); a step whose rounds "
             "keep no group is skipped and counted (--max_failed_steps)")
    enable_vllm_is_correction: bool = flag(
        False, "--algo.advantage.is_correction_enable",
        help="importance-sampling correction for the engine's log-probs differing from the trainer's")
    vllm_is_truncated_threshold: list[float] = flag(
        [0.5, 5.0], "--algo.advantage.is_correction_threshold", nargs=2,
        help="LOW HIGH bounds of the importance ratio of --enable_vllm_is_correction")
    vllm_is_correction_type: Literal["tis", "icepop", "seq-mask-tis"] = flag(
        "tis", "--algo.advantage.is_correction_type",
        help="tis: truncate the ratio at HIGH; icepop: mask tokens outside [LOW, HIGH]; seq-mask-tis: mask whole "
             "sequences")
    use_icepop: bool = flag(False, help="alias of --enable_vllm_is_correction --vllm_is_correction_type icepop")


@dataclass
class PlacementFlags:
    """train_ppo_ray's placement: nodes and GPUs per role, rollout engines, weight sync, colocation, sleep."""

    actor_num_nodes: int = flag(1, "--actor.num_nodes", group=RL_PLACEMENT,
                                help="nodes of the actor model's workers (train_ppo_ray)")
    actor_num_gpus_per_node: int = flag(1, "--actor.num_gpus_per_node",
                                        help="GPUs per node of the actor model's workers (train_ppo_ray)")
    ref_num_nodes: int = flag(1, "--ref.num_nodes", help="nodes of the ref model's workers (train_ppo_ray)")
    ref_num_gpus_per_node: int = flag(1, "--ref.num_gpus_per_node",
                                      help="GPUs per node of the ref model's workers (train_ppo_ray)")
    critic_num_nodes: int = flag(1, "--critic.num_nodes", help="nodes of the critic model's workers (train_ppo_ray)")
    critic_num_gpus_per_node: int = flag(1, "--critic.num_gpus_per_node",
                                         help="GPUs per node of the critic model's workers (train_ppo_ray)")
    reward_num_nodes: int = flag(1, "--reward.num_nodes", help="nodes of the reward model's workers (train_ppo_ray)")
    reward_num_gpus_per_node: int = flag(1, "--reward.num_gpus_per_node",
                                         help="GPUs per node of the reward model's workers (train_ppo_ray)")
    vllm_num_engines: int = flag(1, "--vllm.num_engines",
                                 help="rollout engines (each on --vllm_tensor_parallel_size GPUs)")
    vllm_tensor_parallel_size: int = flag(1, "--vllm.tensor_parallel_size",
                                          help="GPUs of one rollout engine (tensor parallel)")
    vllm_sync_backend: str = flag("nccl", "--vllm.sync_backend",
                                  help="process-group backend of the weight broadcast to engines: nccl or gloo")
    vllm_sync_with_ray: bool = flag(False, "--vllm.sync_with_ray",
                                    help="OpenRLHF: weight sync through ray.util.collective")
    weight_sync: WeightSyncMethod = flag(
        "auto",
        help="policy -> engines weight sync after each step: broadcast (an NCCL group on GPUs, gloo on CPU), ipc "
             "(CUDA IPC handles, engines colocated with the policy), object_store (Ray's object store); auto: ipc "
             "when every engine shares a GPU with a policy rank, else broadcast")
    weight_sync_bucket_mb: int = flag(DEFAULT_BUCKET_MB,
                                      help="weight sync bucket size in MB (one broadcast / IPC handle each)")
    vllm_gpu_memory_utilization: float = flag(0.95, "--vllm.gpu_memory_utilization",
                                              help="fraction of GPU memory a vLLM engine may take")
    vllm_enable_sleep: bool = flag(
        False, "--vllm.enable_sleep",
        help="engines free their GPU memory (weights, KV cache) while the models train; train_ppo's engine frees "
             "its KV cache and decode graphs (and its own copy of the weights, if it has one)")
    enforce_eager: bool = flag(False, "--vllm.enforce_eager", help="vLLM without CUDA graphs")
    colocate_all_models: bool = flag(False, "--train.colocate_all",
                                     help="actor, reference, critic, reward model and engines share the same GPUs")
    colocate_actor_ref: bool = flag(False, "--train.colocate_actor_ref",
                                    help="the reference model shares the actor's GPUs")
    colocate_critic_reward: bool = flag(False, "--train.colocate_critic_reward",
                                        help="the reward model shares the critic's GPUs")
    deepspeed_enable_sleep: bool = flag(
        False, "--ds.enable_sleep", "--fsdp2_enable_sleep", "--fsdp.enable_sleep",
        help="training states (optimizer, fp32 master weights, gradients) to host memory between phases; "
             "--fsdp2_enable_sleep and --fsdp.enable_sleep are OpenRLHF's FSDP2-era names of the same flag")
    skip_memory_check: bool = flag(
        False, help="start even when the per-GPU memory plan exceeds the GPU (train_ppo_ray prints the plan)")


@dataclass
class RayFlags:
    """train_ppo_ray's Ray cluster: where it is, what a worker slot reserves, how long to wait."""

    ray_address: str | None = flag(
        None, group=RL_PLACEMENT,
        help="cluster to join, or `local` for a new local Ray (default: $RAY_ADDRESS, else the last `ray start` on "
             "this machine, else a new local Ray)")
    ray_num_cpus_per_worker: float = flag(1.0, help="CPUs reserved with each GPU / CPU worker slot")
    ray_accelerator_resource: str | None = flag(
        None, help="resource that --*_num_gpus_per_node counts (default: GPU if the cluster has GPUs, else CPU)")
    ray_placement_timeout: float = flag(60.0, help="seconds to wait for the placement groups")
    ray_health_interval: float = flag(5.0, help="seconds between actor health checks")


def add_rl_flags(p: FlagParser) -> None:
    add_model_flags(p)
    add_backend_flags(p)
    add_ckpt_flags(p)
    add_logging_flags(p, wandb_project="rlhfkit_train_ppo", eval_default="never")
    add_fields(p, CompletionLogFlags)
    _models(p)
    _data(p)
    add_image_flags(p)
    _rollout(p)
    _train(p)
    _algo(p)
    _reward(p)
    placement = [f.name for f in flag_fields(PlacementFlags)]
    cut = placement.index("enforce_eager")  # --enable_prefix_caching (SamplingFlags') goes before it
    with p.group(RL_PLACEMENT):
        add_fields(p, PlacementFlags, placement[:cut])
        add_prefix_caching_flag(p)
        add_fields(p, PlacementFlags, placement[cut:])
    _eval(p)
    add_fields(p, PromptDataFlags, ["pretrain_data", "pretrain_data_probs", "pretrain_split", "ptx_coef"])


def _models(p: FlagParser) -> None:
    with p.group(RL_MODELS):
        add_reward_model_flag(p, "reward model directory or hub id (a sequence classifier with one output); several, "
                                 "comma-separated, are summed")
        add_fields(p, RLModelFlags, ["critic_pretrain"])
        add_ref_model_flags(p, of=" of the KL term,")
        add_value_head_flag(p)
        add_fields(p, RLModelFlags, ["ref_reward_offload", "reward_offload"])
    with p.group(RL_REWARD):
        add_fields(p, InputsConfig, ["remote_rm_url"], here=True)
        add_fields(p, RewardSourceFlags, ["agent_func_path"])
    with p.group(RL_ROLLOUT):
        add_rollout_engine_flag(p, ROLLOUT_ENGINE_HELP + " (one line says which and why)")
        add_fields(p, RolloutFlags, ["rollout_max_num_seqs", "engine_weights", "rollout_compile"])


def _data(p: FlagParser) -> None:
    with p.group(DATA):
        add_fields(p, InputsConfig, ["prompt_data"], here=True)
        add_fields(p, PromptDataFlags, ["prompt_data_probs", "prompt_split"])
        p.alias("--prompt_split", "--train_split")  # OpenRLHF's old name of the split, as --dataset_split's
        add_input_key_flag(p, "column with the prompt text or conversation")
        add_label_key_flag(p, "column handed to reward_func / the agent as the label (e.g. the reference answer)")
        add_template_flags(p)
        add_max_samples_flag(p, "read at most this many prompts")
        add_max_row_bytes_flag(p)
        add_max_len_flag(p, "prompt + response token budget (default: --prompt_max_len + --generate_max_len)")
        add_prompt_max_len_flag(p)
        add_dataloader_workers_flag(p)
    p.set_defaults(max_samples=int(1e8), max_len=None)


def _rollout(p: FlagParser) -> None:
    with p.group(RL_ROLLOUT):
        add_rollout_batch_flag(p)
        add_fields(p, RolloutFlags, ["n_samples_per_prompt", "micro_rollout_batch_size"])
        add_max_new_tokens_flag(p)
        add_temperature_flag(p, "sampling temperature (the training log-probs use it too)", rl=True)
        add_top_p_flag(p, rl=True)
        add_fields(p, RolloutFlags, ["top_k", "rollout_max_tokens_per_gpu", "vllm_generate_batch_size"])


def _train(p: FlagParser) -> None:
    with p.group(TRAIN):
        add_batch_flags(p, batch_help="samples per optimizer step (all ranks together); a rollout of "
                        "--rollout_batch_size x --n_samples_per_prompt samples makes that many / this many steps",
                        epochs_help="PPO epochs over each rollout")
        add_fields(p, RLTrainFlags, ["recompute_old_logprobs", "num_episodes"])
        add_max_steps_flag(p, "RL steps to take (a rollout and its policy update each), cycling the prompts as "
                              "often as needed (overrides --num_episodes)")
        add_seed_flag(p, "seed of python, numpy, torch, data and sampling", trainer=True)
        add_full_determinism_flag(p)
        add_fields(p, RLTrainFlags, ["use_dynamic_batch", "train_max_tokens_per_gpu", "freezing_actor_steps",
                                      "save_value_network", "enable_ema", "ema_beta", "actor_init_on_gpu", "perf"])
        add_nonfinite_flag(p)
        add_fields(p, RLTrainFlags, ["max_failed_steps"])
    p.set_defaults(micro_train_batch_size=1, max_epochs=1)
    with p.group(OPTIM):
        add_fields(p, RLTrainFlags, ["actor_learning_rate", "critic_learning_rate"])
        add_adam_flags(p, actor=True, note=" (the flat name sets the critic's too)")
        add_schedule_flags(p, actor=True)
        add_optimizer_choice_flags(p, actor=True)
    add_fields(p, CriticOptimFlags)
    add_fields(p, RLTrainFlags, ["async_train", "async_queue_size", "partial_rollout"])
    with p.group(RL_REWARD):
        add_fields(p, RewardSourceFlags, ["reward_failure", "reward_timeout", "reward_workers"])


def _algo(p: FlagParser) -> None:
    add_fields(p, AlgoFlags)
    p.implies("--use_icepop", vllm_is_correction_type="icepop")
    p.exclusive("--clip_eps_low", "--eps_clip_low_high", "both set the lower clip")
    p.exclusive("--clip_eps_high", "--eps_clip_low_high", "both set the upper clip")


def _reward(p: FlagParser) -> None:
    with p.group(RL_REWARD):
        add_normalize_reward_flag(p)
        add_fields(p, RewardSourceFlags, ["reward_clip_range", "overlong_buffer_len", "overlong_penalty_factor",
                                           "stop_properly_penalty_coef"])


def _eval(p: FlagParser) -> None:
    with p.group(EVAL):
        add_eval_data_flags(p, "evaluation prompts, same format as --prompt_data (scored by --remote_rm_url / the "
                               "agent)")
        add_fields(p, PromptDataFlags, ["eval_temperature", "eval_n_samples_per_prompt", "eval_max_samples"])
    add_fields(p, BestCheckpointFlags)


# Flags that only take effect under train_ppo_ray: (dest, default) pairs.
RAY_ONLY = [f"{r}_num_nodes" for r in ROLES] + [f"{r}_num_gpus_per_node" for r in ROLES] + [
    "vllm_num_engines", "vllm_tensor_parallel_size", "vllm_sync_backend", "vllm_sync_with_ray",
    "weight_sync", "weight_sync_bucket_mb",
    "vllm_gpu_memory_utilization", "enable_prefix_caching", "enforce_eager",
    "colocate_all_models", "colocate_actor_ref", "colocate_critic_reward", "deepspeed_enable_sleep",
    "async_train", "async_queue_size", "partial_rollout", "skip_memory_check",
]
