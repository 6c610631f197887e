"""The flag table: OpenRLHF's flat flag names, their newer dotted aliases, our defaults and help.

Each CLI builds one `FlagParser` (rlhfkit.config.flag_parser: help groups, --config files, conflict
checks, --version) and adds the groups it needs (`add_model_flags`, ...). A flag is declared once
with all of its names; the first name is the flat one and gives the `dest`. Unknown flags fail with
the closest valid name:

    $ python -m rlhfkit.cli.train_sft --lerning_rate 1e-5
    train_sft: error: unknown flag --lerning_rate (did you mean --learning_rate?)

`parse()` returns an `argparse.Namespace`; `rlhfkit.config.configs` turns it into the
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

from rlhfkit.config.configs import ModelConfig
from rlhfkit.config.declare import add_fields, flag_fields
from rlhfkit.config.flag_parser import (BACKEND, CKPT, DATA, EVAL, LOGGING, LORA, MODEL, OPTIM,  # noqa: F401
                                        TRAIN, FlagParser, describe, parsed_values, str2bool)
from rlhfkit.fileio import atomic_write_text
from rlhfkit.redact import redact_config


# --lr_scheduler: the names of transformers.SchedulerType that need nothing but warm-up and total steps
# (and --min_lr_ratio); reduce_lr_on_plateau needs a metric, warmup_stable_decay its own phase lengths
LR_SCHEDULES = ("cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts",
                "polynomial", "inverse_sqrt", "cosine_warmup_with_min_lr")
LR_SCHEDULER_HELP = ("learning-rate schedule (transformers.get_scheduler), after a linear warm-up from 0")
MIN_LR_HELP = "cosine_with_min_lr, cosine_warmup_with_min_lr: the learning rate ends at this fraction of the peak"


# Each flag name is declared once in rlhfkit/ (tests/unit/test_flags_declared_once.py): as a field of a
# component config (rlhfkit.config.configs, added with rlhfkit.config.declare.add_fields, which takes what
# differs between the commands: the help's wording, the names accepted), or, for the flags not moved there
# yet, by one function below that takes the same as parameters. Its default is written there once; a command
# that needs another default sets it after the declaration with `p.set_defaults(dest=value)` (argparse
# updates the flag's default, so --help and the flag reference show the command's own).


def add_packing_flag(p: FlagParser, help: str = "pack several samples into one row without padding (attention "
                                                "kept within each sample)", inert: str | None = None) -> None:
    p.flag("--packing_samples", "--ds.packing_samples", action="store_true", help=help, inert=inert)


def add_device_flag(p: FlagParser) -> None:
    p.flag("--device", type=str, default=None, help="cpu or cuda (default: cuda when available)")


def add_model_name_alias_flag(p: FlagParser) -> None:
    """--model_name_or_path: another name of --pretrain (batch_inference, interactive_chat)."""
    p.flag("--model_name_or_path", dest="pretrain", type=str, default=None, help="alias of --pretrain")


# the model and LoRA groups: every flag of ModelConfig but --freeze_visual_encoder (add_image_flags)
MODEL_FLAGS = tuple(f.name for f in flag_fields(ModelConfig) if f.name != "freeze_visual_encoder")


def add_model_flags(p: FlagParser) -> None:
    add_fields(p, ModelConfig, MODEL_FLAGS)


TRAINING_ONLY = ("gradient_checkpointing", "mixed_precision", "torch_compile", "aux_loss_coef")


def mark_training_only(p: FlagParser) -> None:
    """The model flags that only matter for training, in a command that only runs the model."""
    for dest in TRAINING_ONLY:
        p.mark_inert(dest, f"a training setting; {p.prog} does not train")


DEFAULT_INPUT_TEMPLATE: str | None = None  # every command: the prompt as it is (rlhfkit.data.templates)
INPUT_TEMPLATE_HELP = "format of the prompt with one {} for the --input_key text (default, or '': the text as it is)"
CHAT_TEMPLATE_HELP = ("format prompts and conversations with the tokenizer's chat template (off: one line says when "
                      "the tokenizer has one)")


def add_template_flags(p: FlagParser, input_help: str = INPUT_TEMPLATE_HELP, chat_help: str = CHAT_TEMPLATE_HELP
                       ) -> None:
    """--input_template (one default for every command), --apply_chat_template, --tokenizer_chat_template."""
    p.flag("--input_template", "--data.input_template", type=str, default=DEFAULT_INPUT_TEMPLATE, help=input_help)
    p.flag("--apply_chat_template", "--data.apply_chat_template", action="store_true", help=chat_help)
    p.flag("--tokenizer_chat_template", "--data.tokenizer_chat_template", type=str, default=None,
           help="a Jinja chat template that replaces the tokenizer's own")


def add_split_flag(p: FlagParser, flat: str, dotted: str, of: str, note: str = "") -> None:
    """The split to read of the data flag `of`; OpenRLHF's --train_split names it too."""
    p.flag(flat, dotted, "--train_split", type=str, default="train", help=f"split of {of} to read{note}")


def add_input_key_flag(p: FlagParser, help: str = "column with the prompt (or the whole text / conversation)"
                       ) -> None:
    p.flag("--input_key", "--data.input_key", type=str, default="input", help=help)


def add_label_key_flag(p: FlagParser, help: str) -> None:
    """--label_key (default: none; a command whose data needs one sets its default)."""
    p.flag("--label_key", "--data.label_key", type=str, default=None, help=help)


def add_max_len_flag(p: FlagParser, help: str = "longest sample in tokens; longer samples are dropped (counted "
                                                "and reported)") -> None:
    p.flag("--max_len", "--data.max_len", type=int, default=2048, help=help)


def add_max_samples_flag(p: FlagParser, help: str = "read at most this many rows of the data (after mixing)") -> None:
    p.flag("--max_samples", "--data.max_samples", type=int, default=1_000_000, help=help)


def add_eval_data_flags(p: FlagParser, help: str = "evaluation data, same format as --dataset (default: no "
                                                   "evaluation)") -> None:
    p.flag("--eval_dataset", "--eval.dataset", type=str, default=None, help=help)
    p.flag("--eval_split", "--eval.split", type=str, default="train", help="split of --eval_dataset to read")


def add_data_flags(p: FlagParser, *, max_len: int | None = None, max_samples: int | None = None) -> None:
    """`max_len`, `max_samples`: the command's defaults of those flags, when not the shared ones."""
    with p.group(DATA):
        p.flag("--dataset", "--data.dataset", type=str, default=None,
               help="training data: comma-separated .jsonl/.json/.parquet/.csv files, folders or dataset names")
        p.flag("--dataset_probs", "--data.dataset_probs", type=str, default=None,
               help="comma-separated sampling probabilities, one per --dataset entry (default: concatenate)")
        add_split_flag(p, "--dataset_split", "--data.dataset_split", "--dataset", " (for datasets with splits)")
        add_input_key_flag(p)
        p.flag("--output_key", "--data.output_key", type=str, default=None,
               help="column with the response (see the command's description)")
        add_template_flags(p)
        add_max_len_flag(p)
        add_max_samples_flag(p)
        add_max_row_bytes_flag(p)
        add_dataloader_workers_flag(p)
    with p.group(EVAL):
        add_eval_data_flags(p)
    p.set_defaults(**{k: v for k, v in (("max_len", max_len), ("max_samples", max_samples)) if v is not None})


def add_image_flags(p: FlagParser) -> None:
    """Vision-language data and models (docs/vlm.md): the pictures of a row, their limits, and
    whether the vision tower trains."""
    with p.group(DATA):
        p.flag("--image_key", "--data.image_key", type=str, default="images",
               help="column with a row's pictures: file paths, http(s) URLs, base64 data URIs or image bytes "
                    "(one, or a list)")
        p.flag("--max_images_per_prompt", "--data.max_images_per_prompt", type=int, default=0,
               help="> 0 turns on vision-language mode: pictures of --image_key go with each sample, at most "
                    "this many (a row with more is an error)")
        p.flag("--image_failure", type=str, default="stop", choices=["stop", "drop"],
               help="a missing, unreadable or too large picture: stop with an error naming file and row, or "
                    "drop its row (counted)")
        p.flag("--max_image_bytes", type=int, default=32 * 2**20, help="largest picture file in bytes")
        p.flag("--max_image_pixels", type=int, default=4096 * 4096, help="largest picture in pixels (width x height)")
    add_fields(p, ModelConfig, ["freeze_visual_encoder"])


def add_dataloader_workers_flag(p: FlagParser) -> None:
    p.flag("--dataloader_num_workers", "--data.dataloader_num_workers", type=int, default=0,
           help="OpenRLHF: DataLoader worker processes",
           inert="data is tokenized once up front and batched in the training process (no loader workers)")


def add_max_row_bytes_flag(p: FlagParser) -> None:
    p.flag("--max_row_bytes", "--data.max_row_bytes", type=int, default=1_000_000,
           help="largest input row in bytes; a larger row is an error naming file and row")


def add_seed_flag(p: FlagParser, help: str = "seed of python, numpy, torch and data shuffling", *,
                  trainer: bool = False) -> None:
    """--seed (default 42); `trainer`: also OpenRLHF's --train.seed."""
    p.flag("--seed", *(("--train.seed",) if trainer else ()), type=int, default=42, help=help)


def add_batch_flags(p: FlagParser, *, batch_help: str = "global samples per optimizer step (all ranks together; "
                    "gradient accumulation makes up the rest)", epochs_help: str = "passes over the data") -> None:
    """--train_batch_size (128), --micro_train_batch_size (8), --max_epochs (2)."""
    p.flag("--train_batch_size", "--train.batch_size", type=int, default=128, help=batch_help)
    p.flag("--micro_train_batch_size", "--train.micro_batch_size", type=int, default=8,
           help="samples per forward/backward pass on each rank")
    p.flag("--max_epochs", "--train.max_epochs", type=int, default=2, help=epochs_help)


def add_full_determinism_flag(p: FlagParser) -> None:
    p.flag("--full_determinism", "--train.full_determinism_enable", action="store_true",
           help="deterministic torch algorithms (transformers.enable_full_determinism): reproducible, slower")


def add_max_steps_flag(p: FlagParser, help: str) -> None:
    p.flag("--max_steps", type=int, default=None, help=help)


def add_adam_flags(p: FlagParser, dotted: str = "adam.", note: str = "") -> None:
    """--adam_betas, --adam_eps, --l2, with the dotted names under `dotted` (adam., actor.adam.)."""
    p.flag("--adam_betas", f"--{dotted}betas", type=float, nargs=2, default=[0.9, 0.95],
           help=f"AdamW beta1 beta2{note}")
    p.flag("--adam_eps", f"--{dotted}eps", type=float, default=1e-8, help=f"AdamW epsilon{note}")
    p.flag("--l2", f"--{dotted}weight_decay", type=float, default=0.0, help=f"AdamW weight decay{note}")


def add_schedule_flags(p: FlagParser, *, actor: bool = False) -> None:
    """--lr_scheduler, --lr_warmup_ratio, --min_lr_ratio, --max_norm; `actor`: also their --actor.* names."""
    p.flag("--lr_scheduler", *(("--actor.lr_scheduler",) if actor else ()), type=str, default="cosine_with_min_lr",
           choices=LR_SCHEDULES, help=LR_SCHEDULER_HELP)
    p.flag("--lr_warmup_ratio", *(("--actor.lr_warmup_ratio",) if actor else ()), type=float, default=0.03,
           help="fraction of the optimizer steps spent warming up linearly from 0")
    p.flag("--min_lr_ratio", *(("--actor.min_lr_ratio",) if actor else ()), type=float, default=0.1,
           help=MIN_LR_HELP)
    p.flag("--max_norm", *(("--actor.max_norm",) if actor else ()), type=float, default=1.0,
           help="clip the gradient's global L2 norm to this (0 disables)")


def add_train_flags(p: FlagParser, *, train_batch_size: int | None = None, micro_train_batch_size: int | None = None,
                    max_epochs: int | None = None, learning_rate: float = 5e-6) -> None:
    """`train_batch_size`, `micro_train_batch_size`, `max_epochs`: the command's defaults, when not the shared ones."""
    with p.group(TRAIN):
        add_batch_flags(p)
        add_seed_flag(p, trainer=True)
        add_full_determinism_flag(p)
    with p.group(OPTIM):
        p.flag("--learning_rate", "--adam.lr", type=float, default=learning_rate, help="peak learning rate")
        add_adam_flags(p)
        add_optimizer_choice_flags(p)
        add_schedule_flags(p)
        add_nonfinite_flag(p)
    p.set_defaults(**{k: v for k, v in (("train_batch_size", train_batch_size),
                                        ("micro_train_batch_size", micro_train_batch_size),
                                        ("max_epochs", max_epochs)) if v is not None})


def add_optimizer_choice_flags(p: FlagParser, flat: str = "", dotted: tuple[str, ...] = ("",)) -> None:
    """--optim adam|adamw_8bit|muon, --master_weights and the Muon settings (rlhfkit.backend.muon). `flat` prefixes the flat
    names and dests (the PPO critic's are `critic_`), `dotted` lists the dotted prefixes:
    ("",) gives --muon.lr (train_sft / rm / dpo), ("actor.",) --actor.optim and --actor.muon.lr."""
    def names(flat_name: str, dotted_name: str) -> list[str]:
        out = [f"--{flat}{flat_name}"]
        out += [n for d in dotted if (n := f"--{d}{dotted_name}") not in out]
        return out

    who = "the critic's " if flat else ""
    p.flag(*names("optim", "optim"), type=str, default="adam", choices=["adam", "adamw_8bit", "muon"],
           help=f"{who}optimizer: adam (AdamW); adamw_8bit: AdamW whose two moments are stored in 8 bits per value "
                "(blockwise float8 codes, 2.03 bytes a parameter instead of 8); or muon: Muon for the 2-D weights "
                "of hidden layers, AdamW for the rest")
    p.flag(*names("master_weights", "master_weights"), type=str, default="fp32",
           choices=["fp32", "bf16_stochastic", "bf16_kahan"],
           help=f"{who}trainable weights: fp32 master weights (the compute copy in --param_dtype); bf16_stochastic: "
                "bf16 weights and gradients, no fp32 copy, each update rounded stochastically; bf16_kahan: the same "
                "with a bf16 compensation of the rounding error (2 more bytes a parameter). The bf16 modes need "
                "--param_dtype bf16 and --optim adam or adamw_8bit")
    p.flag(*names("muon_lr", "muon.lr"), type=float, default=0.02, help=f"{who}Muon learning rate (--{flat}optim muon)")
    p.flag(*names("muon_momentum", "muon.momentum"), type=float, default=0.95, help=f"{who}Muon momentum")
    p.flag(*names("muon_ns_steps", "muon.ns_steps"), type=int, default=5,
           help=f"{who}Muon: Newton-Schulz iterations that orthogonalise the update")
    p.flag(*names("muon_nesterov", "muon.nesterov"), action="store_true", default=True,
           help=f"{who}Muon: Nesterov momentum (default)")
    p.flag(*names("muon_no_nesterov", "muon.no_nesterov"), dest=f"{flat}muon_nesterov", action="store_false",
           help=f"{who}Muon: plain momentum")


def add_nonfinite_flag(p: FlagParser) -> None:
    """The step guard's limits (rlhfkit.backend.guard): non-finite numbers and divergence."""
    p.flag("--max_nonfinite_steps", type=int, default=3,
           help="optimizer steps with a non-finite loss or gradient are skipped; more than this many "
                "in a row (or a non-finite weight) stop the run with exit code 1, nothing saved")
    p.flag("--max_weight_growth", type=float, default=100.0,
           help="a trainable weight whose magnitude exceeds this many times the largest at the start of "
                "training (at least 1) stops the run with exit code 1, nothing saved (0: off)")
    p.flag("--max_zero_grad_steps", type=int, default=3,
           help="more than this many optimizer steps in a row whose gradient is exactly 0 while the loss is "
                "not (a saturated model) stop the run with exit code 1, nothing saved (-1: off)")


def add_backend_flags(p: FlagParser) -> None:
    ds_only = "a DeepSpeed setting; the FSDP2 backend has no equivalent"
    with p.group(BACKEND):
        p.flag("--backend", type=str, default="fsdp2", choices=["fsdp2", "deepspeed"],
               help="training backend (fsdp2: PyTorch FSDP2, nothing extra to install)")
        add_zero_stage_flag(p)
        add_local_rank_flag(p)
        p.flag("--adam_offload", "--ds.adam_offload", action="store_true",
               help="keep optimizer states and fp32 master weights in host memory (CUDA only)")
        add_packing_flag(p)
        p.flag("--ring_attn_size", "--ds.ring_attn_size", type=int, default=1,
               help="context parallelism: each sequence is split over this many ranks, whose attention "
                    "passes key/value blocks round a ring (must divide the world size; 1: off)")
        p.flag("--ring_head_stride", "--ds.ring_attn_head_stride", type=int, default=1,
               help="key/value heads that go round the ring together with --ring_attn_size > 1 (must divide "
                    "the model's key/value heads; larger: fewer, bigger ring passes)")
        p.flag("--ds_tensor_parallel_size", "--ds.tensor_parallel_size", type=int, default=1,
               help="tensor-parallel training size: attention heads, MLP and vocabulary split over this many "
                    "ranks (Llama, Qwen2/3, Mistral), FSDP over the rest of the world")
        p.flag("--zpg", "--ds.zpg", type=int, default=1, help="OpenRLHF: ZeRO++ hierarchical partition size",
               inert=ds_only)
        p.flag("--overlap_comm", "--ds.overlap_comm", action="store_true",
               help="OpenRLHF: overlap DeepSpeed's gradient reduction with the backward pass", inert=ds_only)
        p.flag("--grad_accum_dtype", "--ds.grad_accum_dtype", type=str, default=None,
               help="OpenRLHF: DeepSpeed's gradient accumulation dtype", inert=ds_only)
        p.flag("--deepcompile", "--ds.deepcompile", action="store_true", help="OpenRLHF: DeepSpeed's DeepCompile",
               inert=ds_only)
        p.flag("--use_universal_ckpt", "--ds.use_universal_ckpt", "--use_ds_universal_ckpt", action="store_true",
               help="OpenRLHF: load DeepSpeed universal checkpoints",
               inert="checkpoints (torch.distributed.checkpoint) load on any number of ranks without conversion")
        add_device_flag(p)


def add_zero_stage_flag(p: FlagParser, help: str = "sharding over data-parallel ranks, in DeepSpeed ZeRO terms: 0 "
                        "replicate; 1/2 shard gradients and optimizer states; 3 shard the weights too",
                        inert: str | None = None) -> None:
    p.flag("--zero_stage", "--ds.zero_stage", type=int, default=2, choices=[0, 1, 2, 3], help=help, inert=inert)


def add_local_rank_flag(p: FlagParser) -> None:
    p.flag("--local_rank", type=int, default=-1, help="OpenRLHF: this process's rank on its node",
           inert="each process reads its rank from the environment (LOCAL_RANK / RANK, set by torchrun and "
                 "the deepspeed launcher)")


def add_ckpt_flags(p: FlagParser) -> None:
    with p.group(CKPT):
        add_save_path_flag(p)
        add_run_dir_flag(p)
        p.flag("--overwrite_output_dir", "--ckpt.overwrite_output_dir", action="store_true",
               help="start over in a --save_path / --run_dir holding an earlier run: its metrics, run_config.json "
                    "and the checkpoints inside it are removed (without it such a folder is refused)")
        p.flag("--save_steps", "--ckpt.save_steps", type=int, default=-1,
               help="save a resumable checkpoint every N optimizer steps (-1: never)")
        p.flag("--ckpt_path", "--ckpt.path", type=str, default=None,
               help="folder of the resumable checkpoints (global_step<N>); default: <run dir>/checkpoints")
        p.flag("--max_ckpt_num", "--ckpt.max_num", type=int, default=3,
               help="keep this many newest checkpoints; older ones are deleted")
        p.flag("--max_ckpt_mem", "--ckpt.max_mem", type=float, default=1e8,
               help="GB the resumable checkpoints in --ckpt_path may hold: after a save the oldest are deleted "
                    "while they hold more (the one just saved always stays); as OpenRLHF's")
        p.flag("--load_checkpoint", "--ckpt.load_enable", action="store_true",
               help="resume from the newest intact checkpoint in --ckpt_path, if there is one (none, and the output "
                    "folders hold an earlier run: an error); its run's model, data, batch and learning-rate settings "
                    "must be this run's")
        p.flag("--allow_resume_changes", type=str, default=None,
               help="--load_checkpoint: accept these settings (comma-separated flag names, or all) differing "
                    "from the checkpoint's run as deliberate changes")
        p.flag("--save_hf_ckpt", "--ckpt.save_hf", action="store_true",
               help="also save a Hugging Face snapshot with each checkpoint (<ckpt_path>/global_step<N>_hf)")
        p.flag("--hf_max_shard_size", type=str, default="5GB",
               help="largest safetensors file of a Hugging Face export, e.g. 5GB, 500MB or bytes")
        p.flag("--save_dtype", type=str, default="auto", choices=["auto", "bf16", "fp16", "fp32"],
               help="dtype of the saved Hugging Face model (auto: the dtype --pretrain's folder stores, else "
                    "the compute dtype)")
        p.flag("--disable_ds_ckpt", "--ckpt.disable_ds", action="store_true",
               help="--save_steps writes no resumable checkpoint (only --save_hf_ckpt snapshots)")
        p.flag("--stop_grace_s", type=float, default=10.0,
               help="on SIGINT / SIGTERM the current step may finish within this many seconds (else it is "
                    "abandoned); then a resumable checkpoint is written, the resume command printed, exit 130 / 143")


def add_save_path_flag(p: FlagParser, help: str = "where the final model is saved in Hugging Face format",
                       required: bool = False) -> None:
    """--save_path (--ckpt.output_dir); default ./ckpt, or `required`."""
    p.flag("--save_path", "--ckpt.output_dir", type=str, required=required, default=None if required else "./ckpt",
           help=help)


def add_run_dir_flag(p: FlagParser, help: str = "metrics.jsonl, run_config.json and plots (default: --save_path)"
                     ) -> None:
    p.flag("--run_dir", type=str, default=None, help=help)


def add_output_path_flag(p: FlagParser, help: str, required: bool = False) -> None:
    p.flag("--output_path", type=str, required=required, default=None, help=help)


def add_progress_flag(p: FlagParser) -> None:
    p.flag("--disable_progress", action="store_true", help="no progress bar")


def add_logging_flags(p: FlagParser, *, wandb_project: str = "rlhfkit", eval_default: str = "once per epoch") -> None:
    with p.group(LOGGING):
        p.flag("--logging_steps", "--logger.logging_steps", type=int, default=1,
               help="log metrics every N optimizer steps")
        p.flag("--use_wandb", "--logger.wandb.key", type=str, default=None,
               help="log to Weights & Biases: an API key, or 'True' to use the logged-in account")
        p.flag("--wandb_org", "--logger.wandb.org", type=str, default=None, help="wandb entity (team or user)")
        p.flag("--wandb_group", "--logger.wandb.group", type=str, default=None, help="wandb run group")
        p.flag("--wandb_project", "--logger.wandb.project", type=str, default=wandb_project, help="wandb project")
        p.flag("--wandb_run_name", "--logger.wandb.run_name", type=str, default=None,
               help="wandb run name (default: wandb's), also the TensorBoard run's folder under --use_tensorboard")
        p.flag("--use_tensorboard", "--logger.tensorboard_dir", type=str, default=None,
               help="write TensorBoard event files to <this folder>/<run name>: --wandb_run_name, else the run "
                    "directory's name and the start time (needs tensorboard)")
        add_progress_flag(p)
    with p.group(EVAL):
        p.flag("--eval_steps", "--eval.steps", type=int, default=-1,
               help=f"evaluate every N steps (-1: {eval_default})")


def add_reward_model_flag(p: FlagParser, help: str) -> None:
    p.flag("--reward_pretrain", "--reward.model_name_or_path", type=str, default=None, help=help)


def add_value_head_flag(p: FlagParser, help: str = "name of the reward / critic model's value head module") -> None:
    """--value_head_prefix (--ds.value_head_prefix, OpenRLHF's misspelt --value_prefix_head); default score."""
    p.flag("--value_head_prefix", "--ds.value_head_prefix", "--value_prefix_head", type=str, default="score", help=help)


def add_normalize_reward_flag(p: FlagParser, help: str = "normalise reward-model scores with the mean / std stored "
                                                         "in its config") -> None:
    p.flag("--normalize_reward", "--reward.normalize_enable", action="store_true", help=help)


def add_ref_model_flags(p: FlagParser, memory: str = "host", of: str = "") -> None:
    """--ref_pretrain and --ref_offload: the reference model (DPO / KTO, the RL KL term)."""
    p.flag("--ref_pretrain", "--ref.model_name_or_path", type=str, default=None,
           help=f"reference model{of} directory or hub id (default: --pretrain)")
    p.flag("--ref_offload", "--ref.offload", action="store_true",
           help=f"keep the reference model in {memory} memory between its forward passes")


def add_beta_flag(p: FlagParser, help: str) -> None:
    """--beta (--model.beta) of DPO / KTO; each command sets its default."""
    p.flag("--beta", "--model.beta", type=float, default=0.1, help=help)


def add_pretrain_mode_flag(p: FlagParser, help: str = "loss on every token of the raw text (no template)") -> None:
    p.flag("--pretrain_mode", "--model.pretrain_mode_enable", action="store_true", help=help)


# generation: train_ppo's rollout flags and batch_inference / interactive_chat's sampling flags
ROLLOUT_ENGINE_HELP = ("generation engine: builtin (continuous batching, no extra package), hf (transformers "
                       "generate, slow reference) or vllm (when installed); auto: builtin when it supports the "
                       "model, else vllm when installed, else hf")


def add_rollout_engine_flag(p: FlagParser, help: str = ROLLOUT_ENGINE_HELP) -> None:
    p.flag("--rollout_engine", type=str, default="auto", choices=["auto", "builtin", "hf", "vllm"], help=help)


def add_rollout_batch_flag(p: FlagParser, help: str = "prompts per RL step", *, rl: bool = True) -> None:
    """--rollout_batch_size (default 1024); `rl`: also --rollout.batch_size."""
    p.flag("--rollout_batch_size", *(("--rollout.batch_size",) if rl else ()), type=int, default=1024, help=help)


def add_prompt_max_len_flag(p: FlagParser, help: str = "longest prompt in tokens; longer prompts are dropped "
                                                       "(counted)") -> None:
    p.flag("--prompt_max_len", type=int, default=1024, help=help)


def add_max_new_tokens_flag(p: FlagParser, help: str, *, rl: bool = True) -> None:
    """`rl`: train_ppo's --generate_max_len (default None), with --max_new_tokens and --rollout.max_new_tokens as
    its aliases; else --max_new_tokens alone (batch_inference sets its default)."""
    p.flag(*(("--generate_max_len",) if rl else ()), "--max_new_tokens", *(("--rollout.max_new_tokens",) if rl else ()),
           type=int, default=None, help=help)


def add_temperature_flag(p: FlagParser, help: str = "sampling temperature", *, rl: bool = False) -> None:
    p.flag("--temperature", *(("--rollout.temperature",) if rl else ()), type=float, default=1.0, help=help)


def add_top_p_flag(p: FlagParser, *, rl: bool = False) -> None:
    p.flag("--top_p", *(("--rollout.top_p",) if rl else ()), type=float, default=1.0,
           help="nucleus sampling: keep this probability mass")


def add_sampling_flags(p: FlagParser, what: str = "completion") -> None:
    """batch_inference and interactive_chat: --greedy_sampling, --temperature, --top_p, --repetition_penalty."""
    p.flag("--greedy_sampling", action="store_true", help="greedy decoding (temperature 0)")
    add_temperature_flag(p)
    add_top_p_flag(p)
    p.flag("--repetition_penalty", type=float, default=1.0,
           help=f"1.0 = none; > 1 discourages repeating tokens of the prompt and the {what}")
    p.implies("--greedy_sampling", temperature=0.0)


def add_csft_flags(p: FlagParser) -> None:
    """--enable_csft and --csft_prompt (conditional SFT)."""
    from rlhfkit.data.post_processors import DEFAULT_CSFT_PROMPT

    p.flag("--enable_csft", action="store_true", help="append ' ' + --csft_prompt + ' ' to each prompt")
    p.flag("--csft_prompt", type=str, default=DEFAULT_CSFT_PROMPT,
           help="conditional SFT score text appended with --enable_csft")


def add_prefix_caching_flag(p: FlagParser, *, rl: bool = True) -> None:
    p.flag("--enable_prefix_caching", *(("--vllm.enable_prefix_caching",) if rl else ()), action="store_true",
           help="vLLM prefix caching (--rollout_engine vllm)")


# the arithmetic task (make_data, quickstart) and the tiny model (make_tiny_model, quickstart)
def add_arithmetic_flags(p: FlagParser, *, train_help: str = "SFT rows in train.jsonl",
                         eval_help: str = "held-out questions in eval.jsonl") -> None:
    """--digits, --plain_order, --num_train (2000), --num_eval (64)."""
    p.flag("--digits", type=int, default=2, help="digits of each number of the additions")
    p.flag("--plain_order", action="store_true",
           help="write sums most-significant digit first (harder for a tiny model)")
    p.flag("--num_train", type=int, default=2000, help=train_help)
    p.flag("--num_eval", type=int, default=64, help=eval_help)


def add_tiny_size_flags(p: FlagParser, of: str = "") -> None:
    """--hidden_size and --num_hidden_layers (--num_layers) of a tiny model; `of`: the help's subject."""
    p.flag("--hidden_size", type=int, default=128, help=f"width of the residual stream{of}")
    p.flag("--num_hidden_layers", "--num_layers", type=int, default=4, help=f"transformer blocks{of}")


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
