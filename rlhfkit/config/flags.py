"""The flag table: which flags each command has, in which help group, with which names and wording.

The flags themselves (type, default, help, flat OpenRLHF name, dotted aliases) are declared once, as
fields of the component configs (rlhfkit.config.configs, rlhfkit.config.rl_flags; see
rlhfkit.config.declare). Each CLI builds one `FlagParser` (rlhfkit.config.flag_parser: help groups,
--config files, conflict checks, --version) and adds the groups it needs with the functions below
(`add_model_flags`, ...), which derive the flags from those fields. Unknown flags fail with the
closest valid name:

    $ python -m rlhfkit.cli.train_sft --lerning_rate 1e-5
    train_sft: error: unknown flag --lerning_rate (did you mean --learning_rate?)

`parse()` returns an `argparse.Namespace`; `rlhfkit.config.configs.from_args` turns it into the
typed per-component configs, so components never see the namespace itself.

Flags accepted for OpenRLHF compatibility that have no effect in a command are declared with
`inert="why"` (or marked later with `mark_inert`); `parse()` prints one line for each of them that
the command line sets to a non-default value (on rank 0 only under torchrun):

    note: --zpg has no effect in train_sft: a DeepSpeed setting; the FSDP2 backend has no equivalent

Flags whose effect depends on the run (the device, the model, other flags) say so where that is
decided. tests/unit/test_flag_audit.py checks that every flag of every command is read by the code
or declared inert here; tests/unit/test_cli_help.py that every flag has a help line and a group.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from typing import Any

from rlhfkit.config.configs import (DEFAULT_INPUT_TEMPLATE, ROLLOUT_ENGINE_HELP, BackendFlags,  # noqa: F401
                                    BatchConfig, BetaFlags, ChatSamplingFlags, CheckpointFlags, DataFlags, InputsConfig,
                                    LabelFlags, LearningRateFlags, LoggingFlags, LRSchedule, ModelFlags,
                                    OfflineDataFlags, OptimFlags, OutputPathFlags, PretrainModeFlags, RefModelFlags,
                                    RewardModelFlags, SamplingFlags, ValueHeadFlags, VisionFlags)
from rlhfkit.config.declare import add_fields, declared_help
from rlhfkit.config.flag_parser import (BACKEND, CKPT, DATA, EVAL, LOGGING, LORA, MODEL, OPTIM,  # noqa: F401
                                        TRAIN, FlagParser, describe, parsed_values, str2bool)
from rlhfkit.fileio import atomic_write_text
from rlhfkit.redact import redact_config


LR_SCHEDULES = typing.get_args(LRSchedule)


# Each flag name is declared once in rlhfkit/ (tests/unit/test_flags_declared_once.py): as a field of a
# component config (rlhfkit.config.configs, added with rlhfkit.config.declare.add_fields, which takes what
# differs between the commands: the help's wording, the names accepted), or, for the flags not moved there
# yet, by one function below that takes the same as parameters. Its default is written there once; a command
# that needs another default sets it after the declaration with `p.set_defaults(dest=value)` (argparse
# updates the flag's default, so --help and the flag reference show the command's own). The add_* functions
# below add the flags a group of commands shares; a flag added alone goes to the group block it is added in.


def _here(p: FlagParser, cls: type, name: str, help: str | None = None, **kw: Any) -> None:
    """Add the one flag `cls.name` in the current group block (`help`: the command's wording)."""
    add_fields(p, cls, [name], help={name: help} if help else {}, here=True, **kw)


def add_packing_flag(p: FlagParser, help: str | None = None, inert: str | None = None) -> None:
    _here(p, BackendFlags, "packing_samples", help, inert={"packing_samples": inert} if inert else {})


def add_device_flag(p: FlagParser) -> None:
    _here(p, BackendFlags, "device")


def add_model_name_alias_flag(p: FlagParser) -> None:
    """--model_name_or_path: another name of --pretrain (batch_inference, interactive_chat)."""
    p.flag("--model_name_or_path", dest="pretrain", type=str, default=None, help="alias of --pretrain")


def add_model_flags(p: FlagParser) -> None:
    """The model and LoRA groups: --pretrain and every flag of ModelFlags."""
    add_fields(p, InputsConfig, ["pretrain"])
    add_fields(p, ModelFlags)


TRAINING_ONLY = ("gradient_checkpointing", "mixed_precision", "torch_compile", "aux_loss_coef")


def mark_training_only(p: FlagParser) -> None:
    """The model flags that only matter for training, in a command that only runs the model."""
    for dest in TRAINING_ONLY:
        p.mark_inert(dest, f"a training setting; {p.prog} does not train")


def add_template_flags(p: FlagParser, input_help: str | None = None, chat_help: str | None = None) -> None:
    """--input_template (one default for every command), --apply_chat_template, --tokenizer_chat_template."""
    helps = {k: v for k, v in (("input_template", input_help), ("apply_chat_template", chat_help)) if v}
    add_fields(p, DataFlags, ["input_template", "apply_chat_template", "tokenizer_chat_template"], help=helps,
               here=True)


def add_input_key_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, DataFlags, "input_key", help)


def add_label_key_flag(p: FlagParser, help: str) -> None:
    """--label_key (default: none; a command whose data needs one sets its default)."""
    _here(p, LabelFlags, "label_key", help)


def add_max_len_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, DataFlags, "max_len", help)


def add_max_samples_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, DataFlags, "max_samples", help)


def add_eval_data_flags(p: FlagParser, help: str | None = None) -> None:
    _here(p, InputsConfig, "eval_dataset", help)
    _here(p, DataFlags, "eval_split")


def add_data_flags(p: FlagParser, *, max_len: int | None = None, max_samples: int | None = None) -> None:
    """`max_len`, `max_samples`: the command's defaults of those flags, when not the shared ones."""
    with p.group(DATA):
        add_fields(p, InputsConfig, ["dataset"], here=True)
        add_fields(p, OfflineDataFlags, ["dataset_probs", "dataset_split"], here=True)
        add_input_key_flag(p)
        add_fields(p, OfflineDataFlags, ["output_key"], here=True)
        add_fields(p, DataFlags, ["input_template", "apply_chat_template", "tokenizer_chat_template", "max_len",
                                  "max_samples", "max_row_bytes", "dataloader_num_workers"], here=True)
    with p.group(EVAL):
        add_eval_data_flags(p)
    p.set_defaults(**{k: v for k, v in (("max_len", max_len), ("max_samples", max_samples)) if v is not None})


def add_image_flags(p: FlagParser) -> None:
    """Vision-language data and models (docs/vlm.md): the pictures of a row, their limits, and
    whether the vision tower trains."""
    add_fields(p, VisionFlags)


def add_dataloader_workers_flag(p: FlagParser) -> None:
    _here(p, DataFlags, "dataloader_num_workers")


def add_max_row_bytes_flag(p: FlagParser) -> None:
    _here(p, DataFlags, "max_row_bytes")


def add_seed_flag(p: FlagParser, help: str | None = None, *, trainer: bool = False) -> None:
    """--seed (default 42); `trainer`: also OpenRLHF's --train.seed."""
    _here(p, BackendFlags, "seed", help, **({} if trainer else {"names": {"seed": ["--seed"]}}))


def add_batch_flags(p: FlagParser, *, batch_help: str | None = None, epochs_help: str | None = None) -> None:
    """--train_batch_size (128), --micro_train_batch_size (8), --max_epochs (2)."""
    helps = {k: v for k, v in (("train_batch_size", batch_help), ("max_epochs", epochs_help)) if v}
    add_fields(p, BatchConfig, ["train_batch_size", "micro_train_batch_size", "max_epochs"], help=helps, here=True)


def add_full_determinism_flag(p: FlagParser) -> None:
    _here(p, BackendFlags, "full_determinism")


def add_max_steps_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, BatchConfig, "max_steps", help)


def add_adam_flags(p: FlagParser, *, actor: bool = False, note: str = "") -> None:
    """--adam_betas, --adam_eps, --l2 with their --adam.* names, or (`actor`) their --actor.adam.* names."""
    names = ["adam_betas", "adam_eps", "l2"]
    add_fields(p, OptimFlags, names, drop=("--adam.",) if actor else ("--actor.",), here=True,
               help={n: declared_help(OptimFlags, n) + note for n in names} if note else {})


def add_schedule_flags(p: FlagParser, *, actor: bool = False) -> None:
    """--lr_scheduler, --lr_warmup_ratio, --min_lr_ratio, --max_norm; `actor`: also their --actor.* names."""
    add_fields(p, OptimFlags, ["lr_scheduler", "lr_warmup_ratio", "min_lr_ratio", "max_norm"],
               drop=() if actor else ("--actor.",), here=True)


def add_train_flags(p: FlagParser, *, train_batch_size: int | None = None, micro_train_batch_size: int | None = None,
                    max_epochs: int | None = None, learning_rate: float | None = None) -> None:
    """`train_batch_size`, `micro_train_batch_size`, `max_epochs`, `learning_rate`: the command's defaults, when not
    the shared ones."""
    with p.group(TRAIN):
        add_batch_flags(p)
        add_seed_flag(p, trainer=True)
        add_full_determinism_flag(p)
    with p.group(OPTIM):
        _here(p, LearningRateFlags, "learning_rate")
        add_adam_flags(p)
        add_optimizer_choice_flags(p)
        add_schedule_flags(p)
        add_nonfinite_flag(p)
    p.set_defaults(**{k: v for k, v in (("train_batch_size", train_batch_size),
                                        ("micro_train_batch_size", micro_train_batch_size),
                                        ("max_epochs", max_epochs), ("learning_rate", learning_rate)) if v is not None})


OPTIMIZER_CHOICE = ("optim", "master_weights", "muon_lr", "muon_momentum", "muon_ns_steps", "muon_nesterov")


def add_optimizer_choice_flags(p: FlagParser, *, actor: bool = False) -> None:
    """--optim adam|adamw_8bit|muon, --master_weights and the Muon settings (rlhfkit.backend.muon), with their
    --muon.* names, or (`actor`) their --actor.* names (the critic's are rlhfkit.config.rl_flags.CriticOptimConfig)."""
    add_fields(p, OptimFlags, OPTIMIZER_CHOICE, drop=("--muon.",) if actor else ("--actor.",), here=True)


def add_nonfinite_flag(p: FlagParser) -> None:
    """The step guard's limits (rlhfkit.backend.guard): non-finite numbers and divergence."""
    add_fields(p, OptimFlags, ["max_nonfinite_steps", "max_weight_growth", "max_zero_grad_steps"], here=True)


def add_backend_flags(p: FlagParser) -> None:
    add_fields(p, BackendFlags, ["backend", "zero_stage", "local_rank", "adam_offload", "packing_samples",
                                  "ring_attn_size", "ring_head_stride", "ds_tensor_parallel_size", "zpg",
                                  "overlap_comm", "grad_accum_dtype", "deepcompile", "use_universal_ckpt", "device"])


def add_zero_stage_flag(p: FlagParser, help: str | None = None, inert: str | None = None) -> None:
    _here(p, BackendFlags, "zero_stage", help, inert={"zero_stage": inert} if inert else {})


def add_local_rank_flag(p: FlagParser) -> None:
    _here(p, BackendFlags, "local_rank")


def add_ckpt_flags(p: FlagParser) -> None:
    with p.group(CKPT):
        add_fields(p, CheckpointFlags, ["save_path", "run_dir", "overwrite_output_dir", "save_steps", "ckpt_path",
                                         "max_ckpt_num", "max_ckpt_mem", "load_checkpoint", "allow_resume_changes",
                                         "save_hf_ckpt"])
        add_fields(p, BackendFlags, ["hf_max_shard_size", "save_dtype"])
        add_fields(p, CheckpointFlags, ["disable_ds_ckpt", "stop_grace_s"])


def add_save_path_flag(p: FlagParser, help: str | None = None, required: bool = False) -> None:
    """--save_path (--ckpt.output_dir); default ./ckpt, or `required`."""
    _here(p, CheckpointFlags, "save_path", help, required=["save_path"] if required else [])


def add_run_dir_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, CheckpointFlags, "run_dir", help)


def add_output_path_flag(p: FlagParser, help: str, required: bool = False) -> None:
    _here(p, OutputPathFlags, "output_path", help, required=["output_path"] if required else [])


def add_progress_flag(p: FlagParser) -> None:
    _here(p, LoggingFlags, "disable_progress")


LOGGING_FLAGS = ("logging_steps", "use_wandb", "wandb_org", "wandb_group", "wandb_project", "wandb_run_name",
                 "use_tensorboard", "disable_progress")


def add_logging_flags(p: FlagParser, *, wandb_project: str | None = None, eval_default: str | None = None) -> None:
    """`wandb_project`: the command's project; `eval_default`: what --eval_steps -1 means in it."""
    add_fields(p, LoggingFlags, LOGGING_FLAGS)
    add_fields(p, LoggingFlags, ["eval_steps"],
               help={"eval_steps": f"evaluate every N steps (-1: {eval_default})"} if eval_default else {})
    if wandb_project:
        p.set_defaults(wandb_project=wandb_project)


def add_reward_model_flag(p: FlagParser, help: str) -> None:
    _here(p, RewardModelFlags, "reward_pretrain", help)


def add_value_head_flag(p: FlagParser, help: str | None = None) -> None:
    """--value_head_prefix (--ds.value_head_prefix, OpenRLHF's misspelt --value_prefix_head); default score."""
    _here(p, ValueHeadFlags, "value_head_prefix", help)


def add_normalize_reward_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, RewardModelFlags, "normalize_reward", help)


def add_ref_model_flags(p: FlagParser, memory: str = "host", of: str = "") -> None:
    """--ref_pretrain and --ref_offload: the reference model (DPO / KTO, the RL KL term)."""
    add_fields(p, RefModelFlags, ["ref_pretrain", "ref_offload"], here=True, help={
        "ref_pretrain": f"reference model{of} directory or hub id (default: --pretrain)",
        "ref_offload": f"keep the reference model in {memory} memory between its forward passes"})


def add_beta_flag(p: FlagParser, help: str) -> None:
    """--beta (--model.beta) of DPO / KTO; each command sets its default."""
    _here(p, BetaFlags, "beta", help)


def add_pretrain_mode_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, PretrainModeFlags, "pretrain_mode", help)


def add_rollout_engine_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, SamplingFlags, "rollout_engine", help)


def add_rollout_batch_flag(p: FlagParser, help: str | None = None, *, rl: bool = True) -> None:
    """--rollout_batch_size (default 1024); `rl`: also --rollout.batch_size."""
    _here(p, SamplingFlags, "rollout_batch_size", help, drop=() if rl else ("--rollout.",))


def add_prompt_max_len_flag(p: FlagParser, help: str | None = None) -> None:
    _here(p, SamplingFlags, "prompt_max_len", help)


def add_max_new_tokens_flag(p: FlagParser, help: str | None = None, *, rl: bool = True) -> None:
    """`rl`: train_ppo's --generate_max_len (default None), with --max_new_tokens and --rollout.max_new_tokens as
    its aliases; else --max_new_tokens alone, whose dest is max_new_tokens (batch_inference sets its default)."""
    _here(p, SamplingFlags, "generate_max_len", help,
          **({} if rl else {"names": {"generate_max_len": ["--max_new_tokens"]},
                            "dests": {"generate_max_len": "max_new_tokens"}}))


def add_temperature_flag(p: FlagParser, help: str | None = None, *, rl: bool = False) -> None:
    _here(p, SamplingFlags, "temperature", help, drop=() if rl else ("--rollout.",))


def add_top_p_flag(p: FlagParser, *, rl: bool = False) -> None:
    _here(p, SamplingFlags, "top_p", drop=() if rl else ("--rollout.",))


def add_sampling_flags(p: FlagParser, what: str | None = None) -> None:
    """batch_inference and interactive_chat: --greedy_sampling, --temperature, --top_p, --repetition_penalty."""
    penalty = f"1.0 = none; > 1 discourages repeating tokens of the prompt and the {what}" if what else None
    _here(p, ChatSamplingFlags, "greedy_sampling")
    add_fields(p, SamplingFlags, ["temperature", "top_p"], here=True, drop=("--rollout.",))
    _here(p, ChatSamplingFlags, "repetition_penalty", penalty)
    p.implies("--greedy_sampling", temperature=0.0)


def add_csft_flags(p: FlagParser) -> None:
    """--enable_csft and --csft_prompt (conditional SFT)."""
    from rlhfkit.data.post_processors import DEFAULT_CSFT_PROMPT

    p.flag("--enable_csft", action="store_true", help="append ' ' + --csft_prompt + ' ' to each prompt")
    p.flag("--csft_prompt", type=str, default=DEFAULT_CSFT_PROMPT,
           help="conditional SFT score text appended with --enable_csft")


def add_prefix_caching_flag(p: FlagParser, *, rl: bool = True) -> None:
    _here(p, SamplingFlags, "enable_prefix_caching", drop=() if rl else ("--vllm.",))


# the arithmetic task (make_data, quickstart)
def add_arithmetic_flags(p: FlagParser, *, train_help: str = "SFT rows in train.jsonl",
                         eval_help: str = "held-out questions in eval.jsonl") -> None:
    """--digits, --plain_order, --num_train (2000), --num_eval (64)."""
    p.flag("--digits", type=int, default=2, help="digits of each number of the additions")
    p.flag("--plain_order", action="store_true",
           help="write sums most-significant digit first (harder for a tiny model)")
    p.flag("--num_train", type=int, default=2000, help=train_help)
    p.flag("--num_eval", type=int, default=64, help=eval_help)


def run_dir_of(args: argparse.Namespace) -> str:
    return args.run_dir or args.save_path


def write_resolved_config(args: argparse.Namespace, run_dir: str, name: str = "run_config.json") -> str:
    """Write every flag's final value as JSON into the run directory. `_as_parsed` holds the values
    the command line gave for the flags the command then resolved (e.g. train_ppo's --generate_max_len
    None -> 1024), so `--config run_config.json` replays the run (rlhfkit.config.config_file)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, name)
    data = redact_config(dict(sorted(vars(args).items())))  # no secret on disk (rlhfkit.redact)
    data["use_wandb"] = bool(data.get("use_wandb"))
    parsed = parsed_values(args)
    if parsed:
        plain = json.loads(json.dumps(data, default=str))
        as_parsed = {k: v for k, v in json.loads(json.dumps(redact_config(parsed), default=str)).items()
                     if k in plain and k != "use_wandb" and plain[k] != v}
        if as_parsed:
            data["_as_parsed"] = as_parsed
    atomic_write_text(path, json.dumps(data, indent=2, default=str))  # a kill never leaves half of it
    return path
