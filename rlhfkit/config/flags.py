"""The flag table: OpenRLHF's flat flag names, their newer dotted aliases, and our defaults.

Each CLI builds one `FlagParser` and adds the groups it needs (`add_model_flags`, ...).
A flag is declared once with all of its names; the first name is the flat one and
gives the `dest`. Unknown flags fail with the closest valid name:

    $ python -m rlhfkit.cli.train_sft --lerning_rate 1e-5
    train_sft: error: unknown flag --lerning_rate (did you mean --learning_rate?)

`parse()` returns an `argparse.Namespace`; `rlhfkit.config.configs` turns it into the
typed per-component configs, so components never see the namespace itself.

Flags accepted for OpenRLHF compatibility that have no effect in a command are declared with
`inert="why"` (or marked later with `mark_inert`); `parse()` prints one line for each of them that
the command line sets to a non-default value (on rank 0 only under torchrun):

    note: --max_ckpt_mem has no effect: checkpoints are rotated by count (--max_ckpt_num)

Flags whose effect depends on the run (the device, the model, other flags) say so where that is
decided. tests/unit/test_flag_audit.py checks that every flag of every command is read by the code
or declared inert here.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Any, Sequence

from rlhfkit.fileio import atomic_write_text


class FlagParser(argparse.ArgumentParser):
    """argparse with exact-match flags, dotted aliases and close-match suggestions."""

    def __init__(self, prog: str, description: str = "") -> None:
        super().__init__(prog=prog, description=description, allow_abbrev=False)
        self.inert: dict[str, str] = {}  # dest -> why the flag has no effect in this command

    def flag(self, *names: str, inert: str | None = None, **kw: Any) -> argparse.Action:
        """Add one flag. The first name is the flat one; later names are aliases. `inert`: the
        flag is accepted but has no effect in this command, for this reason (a note says so)."""
        if "dest" not in kw:
            kw["dest"] = names[0].lstrip("-").replace(".", "_").replace("-", "_")
        action = self.add_argument(*names, **kw)
        if inert:
            self.inert[action.dest] = inert
        return action

    def mark_inert(self, dest: str, why: str) -> None:
        """Declare an existing flag as having no effect in this command (one note when it is set)."""
        if not any(a.dest == dest for a in self._actions):
            raise KeyError(f"{self.prog}: no flag with dest {dest!r}")
        self.inert[dest] = why

    def option_name(self, dest: str) -> str:
        """The first (flat) spelling of `dest`'s flag, e.g. --max_ckpt_mem."""
        for a in self._actions:
            if a.dest == dest and a.option_strings:
                return a.option_strings[0]
        return "--" + dest

    def inert_notes(self, ns: argparse.Namespace) -> list[str]:
        """One note line per inert flag that `ns` sets to a non-default value."""
        return [f"note: {self.option_name(d)} has no effect: {why}" for d, why in self.inert.items()
                if getattr(ns, d, None) != self.get_default(d)]

    def has_flag(self, name: str) -> bool:
        return name in self._option_string_actions

    def valid_names(self) -> list[str]:
        return [s for s in self._option_string_actions if s.startswith("--")]

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        argv = list(sys.argv[1:] if argv is None else argv)
        ns, unknown = self.parse_known_args(argv)
        flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
        if flags:
            msgs = []
            for f in flags:
                close = difflib.get_close_matches(f, self.valid_names(), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                msgs.append(f"unknown flag {f}{hint}")
            self.error("; ".join(msgs))
        if unknown:
            self.error(f"unexpected arguments: {' '.join(unknown)}")
        if os.environ.get("RANK", "0") == "0":
            for line in self.inert_notes(ns):
                print(line, flush=True)
        return ns


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


# ----------------------------------------------------------------------------- groups


def add_model_flags(p: FlagParser, default_dtype: str = "bf16") -> None:
    p.flag("--pretrain", "--model.model_name_or_path", "--actor.model_name_or_path",
           type=str, default=None, help="model directory or hub id (org/name: HF cache, else the hub when online)")
    p.flag("--param_dtype", "--ds.param_dtype", type=str, default=default_dtype,
           choices=["bf16", "fp16", "fp32"], help="compute dtype on GPU (master weights stay fp32); CPU training computes in fp32")
    p.flag("--bf16", dest="param_dtype", action="store_const", const="bf16", help="alias of --param_dtype bf16")
    p.flag("--attn_implementation", "--ds.attn_implementation", type=str, default="sdpa",
           help="sdpa (default), eager, flash_attention_2 (when installed)")
    p.flag("--flash_attn", dest="attn_implementation", action="store_const", const="flash_attention_2",
           help="alias of --attn_implementation flash_attention_2")
    p.flag("--gradient_checkpointing", "--model.gradient_checkpointing_enable",
           "--actor.gradient_checkpointing_enable", action="store_true")
    p.flag("--mixed_precision", type=str, default="master_weights", choices=["master_weights", "autocast"],
           help="one process with bf16/fp16 compute: master_weights (module in the compute dtype, fp32 "
                "copies in the optimizer; default) or autocast (fp32 module under torch.autocast)")
    p.flag("--torch_compile", action="store_true", help="torch.compile each transformer block of trained models")
    p.flag("--gradient_checkpointing_use_reentrant", "--model.gradient_checkpointing_reentrant",
           "--actor.gradient_checkpointing_reentrant", action="store_true")
    p.flag("--lora_rank", "--ds.lora.rank", type=int, default=0)
    p.flag("--lora_alpha", "--ds.lora.alpha", type=int, default=16)
    p.flag("--target_modules", "--ds.lora.target_modules", type=str, nargs="*", default=["all-linear"])
    p.flag("--lora_dropout", "--ds.lora.dropout", type=float, default=0.0)
    p.flag("--load_in_4bit", "--ds.load_in_4bit", action="store_true")
    p.flag("--disable_fast_tokenizer", "--data.disable_fast_tokenizer", action="store_true")
    p.flag("--use_liger_kernel", "--ds.use_liger_kernel", action="store_true",
           inert="Liger kernels are not used; the log-prob kernel is fused already (rlhfkit.models.fused_logprobs)")
    p.flag("--aux_loss_coef", "--model.aux_loss_coef", "--actor.aux_loss_coef", type=float, default=0.0,
           help="weight of a mixture-of-experts model's router load-balancing loss (0: off)")
    p.flag("--experts_implementation", "--ds.experts_implementation", type=str, default=None,
           help="mixture-of-experts kernels of transformers: eager, batched_mm, grouped_mm, deepgemm")
    p.flag("--use_ms", action="store_true", help="download model ids from ModelScope (needs modelscope)")


TRAINING_ONLY = ("gradient_checkpointing", "mixed_precision", "torch_compile", "aux_loss_coef")


def mark_training_only(p: FlagParser) -> None:
    """The model flags that only matter for training, in a command that only runs the model."""
    for dest in TRAINING_ONLY:
        p.mark_inert(dest, f"a training setting; {p.prog} does not train")


def add_data_flags(p: FlagParser, *, max_len: int = 2048, max_samples: int = 1_000_000,
                   input_template: str | None = None) -> None:
    p.flag("--dataset", "--data.dataset", type=str, default=None,
           help="comma-separated files, folders or dataset names")
    p.flag("--dataset_probs", "--data.dataset_probs", type=str, default=None,
           help="comma-separated sampling probabilities, one per --dataset entry")
    p.flag("--dataset_split", "--data.dataset_split", "--train_split", type=str, default="train")
    p.flag("--eval_dataset", "--eval.dataset", type=str, default=None)
    p.flag("--eval_split", "--eval.split", type=str, default="train")
    p.flag("--input_key", "--data.input_key", type=str, default="input")
    p.flag("--output_key", "--data.output_key", type=str, default=None)
    p.flag("--input_template", "--data.input_template", type=str, default=input_template)
    p.flag("--apply_chat_template", "--data.apply_chat_template", action="store_true")
    p.flag("--tokenizer_chat_template", "--data.tokenizer_chat_template", type=str, default=None)
    p.flag("--max_len", "--data.max_len", type=int, default=max_len)
    p.flag("--max_samples", "--data.max_samples", type=int, default=max_samples)
    add_max_row_bytes_flag(p)
    add_dataloader_workers_flag(p)


def add_dataloader_workers_flag(p: FlagParser) -> None:
    p.flag("--dataloader_num_workers", "--data.dataloader_num_workers", type=int, default=0,
           inert="data is tokenized once up front and batched in the training process (no loader workers)")


def add_max_row_bytes_flag(p: FlagParser) -> None:
    p.flag("--max_row_bytes", "--data.max_row_bytes", type=int, default=1_000_000,
           help="largest input row in bytes (default 1 MB); a larger row is an error naming file and row")


def add_train_flags(p: FlagParser, *, train_batch_size: int = 128, micro_train_batch_size: int = 8,
                    max_epochs: int = 2, learning_rate: float = 5e-6) -> None:
    p.flag("--train_batch_size", "--train.batch_size", type=int, default=train_batch_size,
           help="global samples per optimizer step")
    p.flag("--micro_train_batch_size", "--train.micro_batch_size", type=int, default=micro_train_batch_size,
           help="samples per forward/backward per rank")
    p.flag("--max_epochs", "--train.max_epochs", type=int, default=max_epochs)
    p.flag("--seed", "--train.seed", type=int, default=42)
    p.flag("--full_determinism", "--train.full_determinism_enable", action="store_true")
    p.flag("--learning_rate", "--adam.lr", type=float, default=learning_rate)
    p.flag("--adam_betas", "--adam.betas", type=float, nargs=2, default=[0.9, 0.95])
    p.flag("--adam_eps", "--adam.eps", type=float, default=1e-8)
    p.flag("--l2", "--adam.weight_decay", type=float, default=0.0)
    add_optimizer_choice_flags(p)
    p.flag("--lr_scheduler", type=str, default="cosine_with_min_lr")
    p.flag("--lr_warmup_ratio", type=float, default=0.03)
    p.flag("--min_lr_ratio", type=float, default=0.1)
    p.flag("--max_norm", type=float, default=1.0, help="gradient clipping (0 disables)")
    add_nonfinite_flag(p)


def add_optimizer_choice_flags(p: FlagParser, flat: str = "", dotted: tuple[str, ...] = ("",)) -> None:
    """--optim adam|muon and the Muon settings (rlhfkit.backend.muon). `flat` prefixes the flat
    names and dests (the PPO critic's are `critic_`), `dotted` lists the dotted prefixes:
    ("",) gives --muon.lr (train_sft / rm / dpo), ("actor.",) --actor.optim and --actor.muon.lr."""
    def names(flat_name: str, dotted_name: str) -> list[str]:
        out = [f"--{flat}{flat_name}"]
        out += [n for d in dotted if (n := f"--{d}{dotted_name}") not in out]
        return out

    p.flag(*names("optim", "optim"), type=str, default="adam", choices=["adam", "muon"],
           help="adam (AdamW), or muon: Muon for the 2-D weights of hidden layers, AdamW for the rest")
    p.flag(*names("muon_lr", "muon.lr"), type=float, default=0.02, help="Muon learning rate")
    p.flag(*names("muon_momentum", "muon.momentum"), type=float, default=0.95)
    p.flag(*names("muon_ns_steps", "muon.ns_steps"), type=int, default=5, help="Newton-Schulz iterations")
    p.flag(*names("muon_nesterov", "muon.nesterov"), action="store_true", default=True,
           help="Nesterov momentum (default)")
    p.flag(*names("muon_no_nesterov", "muon.no_nesterov"), dest=f"{flat}muon_nesterov", action="store_false",
           help="plain momentum")


def add_nonfinite_flag(p: FlagParser) -> None:
    p.flag("--max_nonfinite_steps", type=int, default=3,
           help="optimizer steps with a non-finite loss or gradient are skipped; more than this many "
                "in a row (or a non-finite weight) stop the run with exit code 1, nothing saved")


def add_backend_flags(p: FlagParser) -> None:
    p.flag("--backend", type=str, default="fsdp2", choices=["fsdp2", "deepspeed"])
    p.flag("--zero_stage", "--ds.zero_stage", type=int, default=2, choices=[0, 1, 2, 3],
           help="0: replicate; 1/2: shard grads+optimizer; 3: shard everything")
    add_local_rank_flag(p)
    p.flag("--adam_offload", "--ds.adam_offload", action="store_true")
    p.flag("--packing_samples", "--ds.packing_samples", action="store_true")
    p.flag("--ring_attn_size", "--ds.ring_attn_size", type=int, default=1)
    p.flag("--ring_head_stride", "--ds.ring_attn_head_stride", type=int, default=1,
           inert="ring attention is not supported (--ring_attn_size must be 1)")
    p.flag("--ds_tensor_parallel_size", "--ds.tensor_parallel_size", type=int, default=1)
    ds_only = "a DeepSpeed setting; the FSDP2 backend has no equivalent"
    p.flag("--zpg", "--ds.zpg", type=int, default=1, inert=ds_only)
    p.flag("--overlap_comm", "--ds.overlap_comm", action="store_true", inert=ds_only)
    p.flag("--grad_accum_dtype", "--ds.grad_accum_dtype", type=str, default=None, inert=ds_only)
    p.flag("--deepcompile", "--ds.deepcompile", action="store_true", inert=ds_only)
    p.flag("--use_universal_ckpt", "--ds.use_universal_ckpt", "--use_ds_universal_ckpt", action="store_true",
           inert="checkpoints (torch.distributed.checkpoint) load on any number of ranks without conversion")
    p.flag("--device", type=str, default=None, help="cpu or cuda (default: cuda when available)")


def add_local_rank_flag(p: FlagParser) -> None:
    p.flag("--local_rank", type=int, default=-1,
           inert="each process reads its rank from the environment (LOCAL_RANK / RANK, set by torchrun and "
                 "the deepspeed launcher)")


def add_ckpt_flags(p: FlagParser, *, ckpt_path: str = "./ckpt/checkpoints") -> None:
    p.flag("--save_path", "--ckpt.output_dir", type=str, default="./ckpt",
           help="final Hugging Face model directory")
    p.flag("--run_dir", type=str, default=None,
           help="metrics.jsonl, config.json and plots (default: --save_path)")
    p.flag("--save_steps", "--ckpt.save_steps", type=int, default=-1)
    p.flag("--ckpt_path", "--ckpt.path", type=str, default=ckpt_path)
    p.flag("--max_ckpt_num", "--ckpt.max_num", type=int, default=3)
    p.flag("--max_ckpt_mem", "--ckpt.max_mem", type=float, default=1e8,
           inert="checkpoints are rotated by count only (--max_ckpt_num)")
    p.flag("--load_checkpoint", "--ckpt.load_enable", action="store_true")
    p.flag("--save_hf_ckpt", "--ckpt.save_hf", action="store_true")
    p.flag("--hf_max_shard_size", type=str, default="5GB",
           help="largest safetensors file of a Hugging Face export, e.g. 5GB, 500MB or bytes")
    p.flag("--disable_ds_ckpt", "--ckpt.disable_ds", action="store_true")


def add_logging_flags(p: FlagParser, *, wandb_project: str = "rlhfkit") -> None:
    p.flag("--logging_steps", "--logger.logging_steps", type=int, default=1)
    p.flag("--eval_steps", "--eval.steps", type=int, default=-1, help="-1: once per epoch")
    p.flag("--use_wandb", "--logger.wandb.key", type=str, default=None,
           help="wandb API key (or 'True' to use the logged-in account)")
    p.flag("--wandb_org", "--logger.wandb.org", type=str, default=None)
    p.flag("--wandb_group", "--logger.wandb.group", type=str, default=None)
    p.flag("--wandb_project", "--logger.wandb.project", type=str, default=wandb_project)
    p.flag("--wandb_run_name", "--logger.wandb.run_name", type=str, default=None)
    p.flag("--use_tensorboard", "--logger.tensorboard_dir", type=str, default=None)
    p.flag("--disable_progress", action="store_true", help="no progress bar")


def run_dir_of(args: argparse.Namespace) -> str:
    return args.run_dir or args.save_path


def write_resolved_config(args: argparse.Namespace, run_dir: str, name: str = "run_config.json") -> str:
    """Write every flag's final value as JSON into the run directory."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, name)
    data = {k: v for k, v in sorted(vars(args).items()) if k not in ("use_wandb",)}
    data["use_wandb"] = bool(getattr(args, "use_wandb", None))
    atomic_write_text(path, json.dumps(data, indent=2, default=str))  # a kill never leaves half of it
    return path
