"""Flags of the RL commands (train_ppo, train_ppo_ray): OpenRLHF's flat names + dotted aliases.

Defaults follow OpenRLHF where a user would expect them (see the shared reference, section 2.1).
Placement and engine flags (`--*_num_nodes`, `--vllm_*`, `--colocate_*`, `--*_enable_sleep`) are
declared here for both commands; `train_ppo` (one process / torchrun) reports them as not taking
effect instead of dropping them silently. Help groups: the shared ones of rlhfkit.config.flags,
then the RL_* groups below.
"""

from __future__ import annotations

from rlhfkit.config.flag_parser import (RL_ALGO, RL_ASYNC, RL_CRITIC, RL_MODELS, RL_PLACEMENT, RL_PTX, RL_REWARD,
                                        RL_ROLLOUT)
from rlhfkit.config.flags import (CKPT, DATA, EVAL, LOGGING, LR_SCHEDULES, OPTIM, ROLLOUT_ENGINE_HELP, TRAIN,
                                  FlagParser, add_adam_flags, add_backend_flags, add_batch_flags, add_ckpt_flags,
                                  add_dataloader_workers_flag, add_eval_data_flags, add_full_determinism_flag,
                                  add_image_flags, add_input_key_flag, add_label_key_flag, add_logging_flags,
                                  add_max_len_flag, add_max_new_tokens_flag, add_max_row_bytes_flag,
                                  add_max_samples_flag, add_max_steps_flag, add_model_flags, add_nonfinite_flag,
                                  add_normalize_reward_flag, add_optimizer_choice_flags, add_prefix_caching_flag,
                                  add_prompt_max_len_flag, add_ref_model_flags, add_reward_model_flag,
                                  add_rollout_batch_flag, add_rollout_engine_flag, add_schedule_flags, add_seed_flag,
                                  add_split_flag, add_temperature_flag, add_template_flags, add_top_p_flag,
                                  add_value_head_flag)
from rlhfkit.weightsync.flags import DEFAULT_BUCKET_MB, METHODS

ESTIMATORS = ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "grpo", "dr_grpo"]  # grpo: group_norm


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


def add_rl_flags(p: FlagParser) -> None:
    add_model_flags(p)
    add_backend_flags(p)
    add_ckpt_flags(p)
    add_logging_flags(p, wandb_project="rlhfkit_train_ppo", eval_default="never")
    _sample_logging(p)
    _models(p)
    _data(p)
    add_image_flags(p)
    _rollout(p)
    _train(p)
    _algo(p)
    _reward(p)
    _placement(p)
    _eval(p)
    _ptx(p)


def _sample_logging(p: FlagParser) -> None:
    with p.group(LOGGING):
        p.flag("--log_completions_steps", type=int, default=10,
               help="every N RL steps (and at step 1) log a table of sampled prompts, completions, rewards and "
                    "labels: completions.jsonl in the run directory, TensorBoard text, a wandb table, and its first "
                    "rows on the console (0: off)")
        p.flag("--log_completions_rows", type=int, default=8,
               help="samples in each --log_completions_steps table, taken from as many prompts as possible")


def _models(p: FlagParser) -> None:
    with p.group(RL_MODELS):
        add_reward_model_flag(p, "reward model directory or hub id (a sequence classifier with one output); several, "
                                 "comma-separated, are summed")
        p.flag("--critic_pretrain", "--critic.model_name_or_path", type=str, default=None,
               help="initial critic (value model; directory or hub id) for --advantage_estimator gae (default: --reward_pretrain, else "
                    "--pretrain)")
        add_ref_model_flags(p, of=" of the KL term,")
        add_value_head_flag(p)
        p.flag("--ref_reward_offload", action="store_true", help="both --ref_offload and --reward_offload")
        p.flag("--reward_offload", "--reward.offload", action="store_true",
               help="keep the reward model(s) in host memory between their forward passes")
    with p.group(RL_REWARD):
        p.flag("--remote_rm_url", "--reward.remote_url", type=str, default=None,
               help="http(s) reward server URL(s), comma-separated, or a .py file defining reward_func(queries, "
                    "prompts, labels)")
        p.flag("--agent_func_path", "--train.agent_func_path", type=str, default=None,
               help="a .py file defining AgentExecutor (multi-turn) or AgentInstance (step() gives the reward)")
    with p.group(RL_ROLLOUT):
        add_rollout_engine_flag(p, ROLLOUT_ENGINE_HELP + " (one line says which and why)")
        p.flag("--rollout_max_num_seqs", type=int, default=None,
               help="sequences the engine decodes at once (default: all samples of a step on this rank, at "
                    "most 512)")
        p.flag("--engine_weights", type=str, choices=["auto", "shared", "copy"], default="auto",
               help="train_ppo in one process: the builtin engine serves the policy's own weights (shared: one copy "
                    "on the device, nothing copied per step) or holds a copy of its own (copy); auto: shared where "
                    "possible (one rank, weights in the engine's dtype; a LoRA policy's adapters are applied unmerged), one "
                    "line says which; train_ppo_ray's engines always hold their own")
        p.flag("--rollout_compile", action="store_true",
               help="torch.compile the builtin engine's decode step (GPU): fewer, fused kernels per step, for "
                    "long runs; its compilation adds 20-30 s to the first step (a few seconds with the cache a "
                    "previous run left, docs/performance.md); off: eager kernels replayed as CUDA graphs")


def _data(p: FlagParser) -> None:
    with p.group(DATA):
        p.flag("--prompt_data", "--data.prompt_dataset", type=str, default=None,
               help="prompts: comma-separated .jsonl/.json/.parquet/.csv files, folders or dataset names")
        p.flag("--prompt_data_probs", "--data.prompt_probs", type=str, default=None,
               help="comma-separated sampling probabilities, one per --prompt_data entry")
        add_split_flag(p, "--prompt_split", "--data.prompt_split", "--prompt_data")
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
        p.flag("--n_samples_per_prompt", "--rollout.n_samples_per_prompt", type=int, default=1,
               help="samples generated per prompt (the group of GRPO / RLOO)")
        p.flag("--micro_rollout_batch_size", "--rollout.micro_batch_size", type=int, default=8,
               help="samples per forward pass when computing log-probs, values and rewards of a rollout")
        add_max_new_tokens_flag(p, "new tokens of one generation (default: 1024; with --max_len given, what "
                                   "--max_len leaves after the prompt, as OpenRLHF's --rollout.max_new_tokens)")
        add_temperature_flag(p, "sampling temperature (the training log-probs use it too)", rl=True)
        add_top_p_flag(p, rl=True)
        p.flag("--top_k", "--rollout.top_k", type=int, default=-1, help="sample from the k likeliest tokens (-1: all)")
        p.flag("--rollout_max_tokens_per_gpu", "--rollout.max_tokens_per_gpu", type=int, default=None,
               help="--use_dynamic_batch: tokens per forward pass of experience making (default: "
                    "--train_max_tokens_per_gpu)")
        p.flag("--vllm_generate_batch_size", "--rollout.vllm_generate_batch_size", type=int, default=None,
               help="OpenRLHF: prompts generated per round (over-sampling)",
               inert="each step generates --rollout_batch_size prompts (dynamic filtering draws more as needed)")


def _train(p: FlagParser) -> None:
    with p.group(TRAIN):
        add_batch_flags(p, batch_help="samples per optimizer step (all ranks together); a rollout of "
                        "--rollout_batch_size x --n_samples_per_prompt samples makes that many / this many steps",
                        epochs_help="PPO epochs over each rollout")
        p.flag("--recompute_old_logprobs", action="store_true",
               help="run the old policy's log-prob pass even when a rollout makes one optimizer step (by default "
                    "the training pass's detached log-probs are the old ones then, ratio 1, as in TRL's GRPO)")
        p.flag("--num_episodes", "--train.num_episodes", type=int, default=1, help="passes over the prompts")
        add_max_steps_flag(p, "RL steps to take (a rollout and its policy update each), cycling the prompts as "
                              "often as needed (overrides --num_episodes)")
        add_seed_flag(p, "seed of python, numpy, torch, data and sampling", trainer=True)
        add_full_determinism_flag(p)
        p.flag("--use_dynamic_batch", "--train.dynamic_batch_enable", action="store_true",
               help="micro-batches by token budget (--train_max_tokens_per_gpu) instead of sample count")
        p.flag("--train_max_tokens_per_gpu", "--train.max_tokens_per_gpu", type=int, default=16192,
               help="--use_dynamic_batch: tokens per training micro-batch on each rank")
        p.flag("--freezing_actor_steps", "--critic.freezing_steps", type=int, default=-1,
               help="train only the critic for the first N steps (critic warm-up; -1: off)")
        p.flag("--save_value_network", "--critic.save_value_network", action="store_true",
               help="also save the critic, to <save_path>_critic")
        p.flag("--enable_ema", "--train.enable_ema", action="store_true",
               help="keep an exponential moving average of the policy's weights; it is what gets saved")
        p.flag("--ema_beta", "--train.ema_beta", type=float, default=None,
               help=f"EMA decay (default {EMA_BETA}): ema = beta * ema + (1 - beta) * weights after every "
                    "optimizer step")
        p.flag("--actor_init_on_gpu", action="store_true", help="OpenRLHF: build the actor directly on the GPU",
               inert="models are loaded on the host and moved (or sharded) onto the device by the backend")
        p.flag("--perf", action="store_true", help="OpenRLHF: log step timings",
               inert="step timings are always logged (time/* in metrics.jsonl)")
        add_nonfinite_flag(p)
        p.flag("--max_failed_steps", type=int, default=3,
               help="steps in a row without a trajectory to train on (all samples dropped or filtered out) "
                    "before the run stops; fewer are skipped and counted in skipped_steps")
    p.set_defaults(micro_train_batch_size=1, max_epochs=1)
    with p.group(OPTIM):
        p.flag("--actor_learning_rate", "--actor.adam.lr", type=float, default=1e-6,
               help="the policy's peak learning rate")
        p.flag("--critic_learning_rate", "--critic.adam.lr", type=float, default=9e-6,
               help="the critic's peak learning rate")
        add_adam_flags(p, "actor.adam.", " (the flat name sets the critic's too)")
        add_schedule_flags(p, actor=True)
        add_optimizer_choice_flags(p, dotted=("actor.",))
    with p.group(RL_CRITIC):
        _critic_optim(p)
    with p.group(RL_ASYNC):
        p.flag("--async_train", "--train.async_enable", action="store_true",
               help="generate the next rollouts while the policy trains (train_ppo_ray)")
        p.flag("--async_queue_size", "--train.async_queue_size", type=int, default=1,
               help="rollouts generated ahead of the policy at most (bounds the off-policyness)")
        p.flag("--partial_rollout", "--train.partial_rollout_enable", action="store_true",
               help="with --async_train: load new weights between decode steps, generations in flight continue")
    with p.group(RL_REWARD):
        p.flag("--reward_failure", type=str, default="stop", choices=["stop", "drop"],
               help="what a reward_func / agent exception does: stop the run, or drop the sample (counted)")
        p.flag("--reward_timeout", type=float, default=300.0,
               help="seconds for one reward_func / agent step call (a reward worker past it is killed); a "
                    "reward server is retried within twice this")
        p.flag("--reward_workers", type=int, default=None,
               help="worker processes that run a --remote_rm_url reward_func .py file (default: the CPU count, "
                    "at most 4): a call past --reward_timeout is killed, and CPU-bound reward code runs beside "
                    "the rollout engine. 0: threads of the trainer, where a call that never returns cannot be "
                    "stopped")


# The critic's optimizer flags: dest -> (dotted name, type, nargs). Unset (None), each takes the
# actor's value, so the flat OpenRLHF names (--adam_betas, --l2, --max_norm, ...) set both models
# as they did; the dotted --critic.* names set the critic's alone (rl_run.builders.resolve_flags).
CRITIC_OPTIM = {
    "adam_betas": ("--critic.adam.betas", float, 2), "adam_eps": ("--critic.adam.eps", float, None),
    "l2": ("--critic.adam.weight_decay", float, None), "lr_scheduler": ("--critic.lr_scheduler", str, None),
    "lr_warmup_ratio": ("--critic.lr_warmup_ratio", float, None),
    "min_lr_ratio": ("--critic.min_lr_ratio", float, None), "max_norm": ("--critic.max_norm", float, None),
}


def _critic_optim(p: FlagParser) -> None:
    for dest, (dotted, typ, nargs) in CRITIC_OPTIM.items():
        p.flag(f"--critic_{dest}", dotted, type=typ, nargs=nargs, default=None,
               choices=LR_SCHEDULES if dest == "lr_scheduler" else None,
               help=f"the critic's --{dest} (default: the actor's)")
    add_optimizer_choice_flags(p, flat="critic_", dotted=("critic.",))


def _ptx(p: FlagParser) -> None:
    """PPO-ptx (InstructGPT): the policy loss plus --ptx_coef x the NLL of pretraining text."""
    with p.group(RL_PTX):
        p.flag("--pretrain_data", type=str, default=None,
               help="text for the PPO-ptx loss: files, folders or dataset names, comma-separated (text in "
                    "--input_key)")
        p.flag("--pretrain_data_probs", type=str, default=None, help="sampling probabilities of --pretrain_data")
        p.flag("--pretrain_split", type=str, default="train", help="split of --pretrain_data to read")
        p.flag("--ptx_coef", type=float, default=None,
               help=f"weight of the PPO-ptx loss (with --pretrain_data; default {PTX_COEF})")


def _algo(p: FlagParser) -> None:
    with p.group(RL_ALGO):
        p.flag("--advantage_estimator", "--algo.advantage.estimator", type=str, default="gae", choices=ESTIMATORS,
               help="gae (PPO with a critic), reinforce (REINFORCE++), reinforce_baseline (REINFORCE++-baseline), "
                    "rloo, group_norm or grpo (GRPO), dr_grpo (Dr. GRPO); the group ones need "
                    "--n_samples_per_prompt > 1")
        p.flag("--gamma", "--algo.advantage.gamma", type=float, default=1.0, help="discount factor of the returns")
        p.flag("--lambd", "--algo.advantage.lambd", type=float, default=1.0,
               help="GAE lambda (--advantage_estimator gae)")
        p.flag("--no_advantage_std_norm", "--algo.advantage.no_std_norm", action="store_true",
               help="normalise advantages by subtracting the mean only, without dividing by the std")
        p.flag("--init_kl_coef", "--algo.kl.init_coef", type=float, default=0.01,
               help="weight of the KL penalty against the reference model (0: no reference model at all)")
        p.flag("--kl_target", "--algo.kl.target", type=float, default=None,
               help="adaptive KL controller: move the KL coefficient towards this KL per sample (default: fixed "
                    "coefficient)")
        p.flag("--kl_horizon", "--algo.kl.horizon", type=int, default=10000,
               help="adaptive KL controller: samples over which the coefficient adapts")
        p.flag("--kl_estimator", "--algo.kl.estimator", type=str, default="k1", choices=["k1", "k2", "k3"],
               help="per-token KL estimator (Schulman's k1 = log ratio, k2 = squared log ratio / 2, k3 = ratio - "
                    "1 - log ratio)")
        p.flag("--use_kl_loss", "--algo.kl.use_loss", action="store_true",
               help="KL as a loss term of the policy (GRPO) instead of a penalty in the reward")
        p.flag("--policy_loss_type", "--actor.policy_loss_type", type=str, default="ppo", choices=["ppo", "gspo"],
               help="ppo: token-level clipped ratio; gspo: sequence-level ratio (GSPO)")
        p.flag("--eps_clip", "--actor.eps_clip", type=float, default=0.2,
               help="PPO clip range: the ratio is clipped to [1 - eps, 1 + eps]")
        p.flag("--eps_clip_low_high", "--actor.eps_clip_low_high", type=float, nargs=2, default=None,
               help="asymmetric clip range LOW HIGH, [1 - low, 1 + high] (DAPO clip-higher; default: --eps_clip "
                    "twice)")
        p.flag("--clip_eps_low", type=float, default=None, help="alias: lower clip (sets --eps_clip_low_high[0])")
        p.flag("--clip_eps_high", type=float, default=None, help="alias: upper clip (sets --eps_clip_low_high[1])")
        p.flag("--dual_clip", "--actor.dual_clip", type=float, default=None,
               help="dual-clip PPO bound c > 1 for negative advantages (default: off)")
        p.flag("--value_clip", "--critic.value_clip", type=float, default=0.5,
               help="the critic's value clip: new values stay within this of the old ones in the loss")
        p.flag("--entropy_loss_coef", "--actor.entropy_coef", type=float, default=None,
               help="weight of an entropy bonus in the policy loss (default: none)")
        p.flag("--dynamic_filtering", "--algo.dynamic_filtering_enable", action="store_true",
               help="DAPO dynamic sampling: drop prompt groups whose mean score lies outside "
                    "--dynamic_filtering_reward_range and generate more")
        p.flag("--dynamic_filtering_reward_range", "--algo.dynamic_filtering_range", type=float, nargs=2,
               default=[0.0, 1.0], help="open interval LOW HIGH of group-mean scores kept by --dynamic_filtering")
        p.flag("--max_filter_rounds", type=int, default=8,
               help="--dynamic_filtering: generation rounds per step at most (the first included); a step whose "
                    "rounds keep no group is skipped and counted (--max_failed_steps)")
        p.flag("--enable_vllm_is_correction", "--algo.advantage.is_correction_enable", action="store_true",
               help="importance-sampling correction for the engine's log-probs differing from the trainer's")
        p.flag("--vllm_is_truncated_threshold", "--algo.advantage.is_correction_threshold", type=float, nargs=2,
               default=[0.5, 5.0], help="LOW HIGH bounds of the importance ratio of --enable_vllm_is_correction")
        p.flag("--vllm_is_correction_type", "--algo.advantage.is_correction_type", type=str, default="tis",
               choices=["tis", "icepop", "seq-mask-tis"],
               help="tis: truncate the ratio at HIGH; icepop: mask tokens outside [LOW, HIGH]; seq-mask-tis: mask "
                    "whole sequences")
        p.flag("--use_icepop", action="store_true",
               help="alias of --enable_vllm_is_correction --vllm_is_correction_type icepop")
    p.implies("--use_icepop", vllm_is_correction_type="icepop")
    p.exclusive("--clip_eps_low", "--eps_clip_low_high", "both set the lower clip")
    p.exclusive("--clip_eps_high", "--eps_clip_low_high", "both set the upper clip")


def _reward(p: FlagParser) -> None:
    with p.group(RL_REWARD):
        add_normalize_reward_flag(p)
        p.flag("--reward_clip_range", "--reward.clip_range", type=float, nargs=2, default=[-10.0, 10.0],
               help="LOW HIGH: clamp the scalar reward to this range before KL shaping")
        p.flag("--overlong_buffer_len", "--reward.overlong_buffer_len", type=int, default=None,
               help="DAPO soft overlong penalty: responses within this many tokens of --generate_max_len lose "
                    "reward linearly (default: off)")
        p.flag("--overlong_penalty_factor", "--reward.overlong_penalty_factor", type=float, default=1.0,
               help="the largest overlong penalty (at --generate_max_len)")
        p.flag("--stop_properly_penalty_coef", "--reward.stop_properly_penalty_coef", type=float, default=None,
               help="ProRL: a truncated response's reward is multiplied by c >= 0, or replaced by c < 0 "
                    "(default: off)")


def _placement(p: FlagParser) -> None:
    with p.group(RL_PLACEMENT):
        for role in ROLES:
            p.flag(f"--{role}_num_nodes", f"--{role}.num_nodes", type=int, default=1,
                   help=f"nodes of the {role} model's workers (train_ppo_ray)")
            p.flag(f"--{role}_num_gpus_per_node", f"--{role}.num_gpus_per_node", type=int, default=1,
                   help=f"GPUs per node of the {role} model's workers (train_ppo_ray)")
        p.flag("--vllm_num_engines", "--vllm.num_engines", type=int, default=1,
               help="rollout engines (each on --vllm_tensor_parallel_size GPUs)")
        p.flag("--vllm_tensor_parallel_size", "--vllm.tensor_parallel_size", type=int, default=1,
               help="GPUs of one rollout engine (tensor parallel)")
        p.flag("--vllm_sync_backend", "--vllm.sync_backend", type=str, default="nccl",
               help="process-group backend of the weight broadcast to engines: nccl or gloo")
        p.flag("--vllm_sync_with_ray", "--vllm.sync_with_ray", action="store_true",
               help="OpenRLHF: weight sync through ray.util.collective")
        p.flag("--weight_sync", type=str, default="auto", choices=list(METHODS),
               help="policy -> engines weight sync after each step: broadcast (an NCCL group on GPUs, gloo on "
                    "CPU), ipc (CUDA IPC handles, engines colocated with the policy), object_store (Ray's object "
                    "store); auto: ipc when every engine shares a GPU with a policy rank, else broadcast")
        p.flag("--weight_sync_bucket_mb", type=int, default=DEFAULT_BUCKET_MB,
               help="weight sync bucket size in MB (one broadcast / IPC handle each)")
        p.flag("--vllm_gpu_memory_utilization", "--vllm.gpu_memory_utilization", type=float, default=0.95,
               help="fraction of GPU memory a vLLM engine may take")
        p.flag("--vllm_enable_sleep", "--vllm.enable_sleep", action="store_true",
               help="engines free their GPU memory (weights, KV cache) while the models train; train_ppo's "
                    "engine frees its KV cache and decode graphs (and its own copy of the weights, if it has one)")
        add_prefix_caching_flag(p)
        p.flag("--enforce_eager", "--vllm.enforce_eager", action="store_true", help="vLLM without CUDA graphs")
        p.flag("--colocate_all_models", "--train.colocate_all", action="store_true",
               help="actor, reference, critic, reward model and engines share the same GPUs")
        p.flag("--colocate_actor_ref", "--train.colocate_actor_ref", action="store_true",
               help="the reference model shares the actor's GPUs")
        p.flag("--colocate_critic_reward", "--train.colocate_critic_reward", action="store_true",
               help="the reward model shares the critic's GPUs")
        p.flag("--deepspeed_enable_sleep", "--ds.enable_sleep", "--fsdp2_enable_sleep", "--fsdp.enable_sleep",
               action="store_true",
               help="training states (optimizer, fp32 master weights, gradients) to host memory between phases; "
                    "--fsdp2_enable_sleep and --fsdp.enable_sleep are OpenRLHF's FSDP2-era names of the same flag")
        p.flag("--skip_memory_check", action="store_true",
               help="start even when the per-GPU memory plan exceeds the GPU (train_ppo_ray prints the plan)")


def _eval(p: FlagParser) -> None:
    with p.group(EVAL):
        add_eval_data_flags(p, "evaluation prompts, same format as --prompt_data (scored by --remote_rm_url / the "
                               "agent)")
        p.flag("--eval_temperature", "--eval.temperature", type=float, default=0.6,
               help="sampling temperature of evaluation")
        p.flag("--eval_n_samples_per_prompt", "--eval.n_samples_per_prompt", type=int, default=4,
               help="samples per evaluation prompt (pass@1 averages them, pass@n takes the best)")
        p.flag("--eval_max_samples", type=int, default=None, help="evaluate on at most this many prompts")
    with p.group(CKPT):
        p.flag("--best_metric_key", "--ckpt.best_metric_key", type=str, default="",
               help="eval metric that picks the best checkpoint ('': the first *_pass1 one; none: off)")


# Flags that only take effect under train_ppo_ray: (dest, default) pairs.
RAY_ONLY = [f"{r}_num_nodes" for r in ROLES] + [f"{r}_num_gpus_per_node" for r in ROLES] + [
    "vllm_num_engines", "vllm_tensor_parallel_size", "vllm_sync_backend", "vllm_sync_with_ray",
    "weight_sync", "weight_sync_bucket_mb",
    "vllm_gpu_memory_utilization", "enable_prefix_caching", "enforce_eager",
    "colocate_all_models", "colocate_actor_ref", "colocate_critic_reward", "deepspeed_enable_sleep",
    "async_train", "async_queue_size", "partial_rollout", "skip_memory_check",
]
