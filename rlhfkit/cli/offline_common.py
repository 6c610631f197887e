"""Plumbing shared by the offline training CLIs (train_rm, train_dpo, train_kto, train_prm, train_kd).

Each CLI is: flags -> `setup` (distributed, seed, tokenizer) -> `load_split_items` (rows ->
tokenized items, dropped samples reported) -> its model(s) and task -> `train_task` (the offline
loop of rlhfkit.trainers.offline, then a final evaluation when the last step had none) -> save.

    add_offline_flags(p, ...)        model / data / train / backend / ckpt / logging groups + --max_steps
    add_pair_key_flags(p)            --prompt_key --chosen_key --rejected_key
    add_ref_flags(p)                 --ref_pretrain (default --pretrain) --ref_offload
    loop_config(args)                LoopConfig from the flags (train_sft could use it too)
    trainable_backend(model, ...)    FSDP2Backend with optimizer and LR schedule
    frozen_model(path, ...)          FrozenModel: a reference / teacher causal LM, no optimizer
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from rlhfkit.parallel.dist import DistInfo, init_distributed
from rlhfkit.parallel.mesh import attach_mesh
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.cli.common import (UsageError, check_backend_flags, check_packing, check_positions, note_cpu_dtype,
                                parallel_dims, check_packages, report_dropped, resolve_model_paths, save_or_fall_back,
                                set_seed)
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig, from_args
from rlhfkit.config.declare import add_fields
from rlhfkit.config.offline_flags import PairKeyFlags
from rlhfkit.config.flags import (MODEL, TRAIN, FlagParser, add_backend_flags, add_ckpt_flags, add_data_flags,
                                  add_logging_flags, add_max_steps_flag, add_model_flags, add_ref_model_flags,
                                  add_train_flags)
from rlhfkit.data.io import DataError, Row, load_mixture
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.models.loader import adopt_causal_lm, check_model_dir, load_causal_lm
from rlhfkit.trainers.dpo_task import FrozenModel
from rlhfkit.trainers.metrics import metrics_record
from rlhfkit.trainers.model_card import task_kind
from rlhfkit.trainers.offline import (LoopConfig, LoopState, evaluate, has_eval, save_resumable, total_steps,
                                      train_offline)
from rlhfkit.trainers.plot import OFFLINE_PANELS
from rlhfkit.trainers.run_settings import allowed_changes, run_settings

log = logging.getLogger(__name__)

OFFLINE_PLOT_KEYS = OFFLINE_PANELS  # the plot's panels (rlhfkit.trainers.plot.PANELS)


def add_offline_flags(p: FlagParser, *, max_len: int, train_batch_size: int, micro_train_batch_size: int,
                      max_epochs: int, learning_rate: float, wandb_project: str) -> None:
    """The flag groups every offline trainer has, with that trainer's OpenRLHF defaults."""
    add_model_flags(p)
    add_data_flags(p, max_len=max_len)
    add_train_flags(p, train_batch_size=train_batch_size, micro_train_batch_size=micro_train_batch_size,
                    max_epochs=max_epochs, learning_rate=learning_rate)
    add_backend_flags(p)
    add_ckpt_flags(p)
    add_logging_flags(p, wandb_project=wandb_project)
    with p.group(TRAIN):
        add_max_steps_flag(p, "optimizer steps to take, cycling the data as often as needed (overrides --max_epochs)")


def add_pair_key_flags(p: FlagParser) -> None:
    """Paired preference columns (reward model, DPO)."""
    add_fields(p, PairKeyFlags)


def add_ref_flags(p: FlagParser) -> None:
    with p.group(MODEL):
        add_ref_model_flags(p, "CPU")


def require(args: argparse.Namespace, *names: str) -> None:
    """Raise a UsageError naming the first flag in `names` that was not given."""
    for name in names:
        if getattr(args, name, None) in (None, ""):
            raise UsageError(f"--{name} is required")


@dataclass
class OfflineRun:
    """What a CLI's `run` returns (tests inspect it): the loop state, backend, task and data."""

    state: LoopState
    backend: Any
    task: Any
    tokenizer: Any
    train_items: Sequence[Any]
    eval_items: Sequence[Any] | None
    extra: dict[str, Any] = field(default_factory=dict)


def setup(args: argparse.Namespace, given: GivenModels = NONE) -> tuple[DistInfo, Any]:
    """Check --pretrain/--dataset, start distributed, seed, and load the tokenizer of --pretrain (or prepare
    the one `given` in memory; a policy given in memory is checked in place of --pretrain's directory)."""
    require(args, "pretrain", "dataset")
    check_backend_flags(args)
    check_packages(args)
    resolve_model_paths(args, skip=(("pretrain",) if given.policy is not None else ())
                        + (("ref_pretrain",) if given.ref is not None else ()))
    if given.policy is None:
        check_model_dir(args.pretrain, "--pretrain")
    elif getattr(args, "max_images_per_prompt", 0) > 0:
        raise UsageError("--max_images_per_prompt: a vision-language model is read with its processor from a "
                         "directory; pass the model's directory, not the loaded model")
    policy = given.policy_or_path(args.pretrain)
    check_positions(policy, args.max_len, f"--max_len {args.max_len}")
    check_packing(args, ("--pretrain", policy))
    dist = init_distributed(args.device)
    note_cpu_dtype(args, dist.device)
    dist = attach_mesh(dist, parallel_dims(args, dist))  # the dp / tp / cp process groups, built once
    set_seed(args.seed, args.full_determinism)
    tokenizer = given.load_tokenizer(args.pretrain, chat_template=args.tokenizer_chat_template,
                                     use_fast=not args.disable_fast_tokenizer)
    return dist, tokenizer


class LoadedItems(list):
    """A dataset's items, with `data_metrics`: what reading it left out or cut, logged with every training step
    (`data/cut_rows`: rows cut at --max_len, their end token not trained)."""

    def __init__(self, items: Sequence[Any], data_metrics: dict[str, float]) -> None:
        super().__init__(items)
        self.data_metrics = data_metrics


def load_items(args: argparse.Namespace, spec: str, split: str, probs: str | None,
               make_dataset: Callable[[list[Row]], Any], flag: str) -> LoadedItems:
    """Rows of `spec` -> the dataset's items; dropped and cut samples are reported, an empty result is an
    error."""
    rows = load_mixture(spec, probs, split=split, max_samples=args.max_samples, seed=args.seed,
                        max_row_bytes=args.max_row_bytes)
    ds = make_dataset(rows)
    bad = getattr(ds, "num_bad_images", 0)
    if bad:
        log.info(f"{bad} of {len(rows)} rows of {spec} dropped for a bad picture (--image_failure drop)")
    report_dropped(ds, len(rows), f"{flag} {spec}", training=flag == "--dataset")
    if not ds.items:
        raise DataError(f"{flag} {spec}: no usable samples ({len(rows)} rows read)")
    return LoadedItems(ds.items, {"data/cut_rows": float(getattr(ds, "num_cut", 0))})



def load_split_items(args: argparse.Namespace, make_dataset: Callable[[list[Row]], Any]
                     ) -> tuple[list[Any], list[Any] | None]:
    """(train items of --dataset, eval items of --eval_dataset or None)."""
    train = load_items(args, args.dataset, args.dataset_split, args.dataset_probs, make_dataset, "--dataset")
    evals = (load_items(args, args.eval_dataset, args.eval_split, None, make_dataset, "--eval_dataset")
             if args.eval_dataset else None)
    return train, evals


def loop_config(args: argparse.Namespace) -> LoopConfig:
    return LoopConfig(train_batch_size=args.train_batch_size, micro_train_batch_size=args.micro_train_batch_size,
                      max_epochs=args.max_epochs, seed=args.seed, logging_steps=args.logging_steps,
                      eval_steps=args.eval_steps, save_steps=args.save_steps, ckpt_path=args.ckpt_path,
                      max_ckpt_num=args.max_ckpt_num, load_checkpoint=args.load_checkpoint,
                      show_progress=not args.disable_progress, max_steps=args.max_steps,
                      aux_loss_coef=args.aux_loss_coef, save_ds=not args.disable_ds_ckpt, save_hf=args.save_hf_ckpt,
                      run_settings=run_settings(vars(args)), allowed_changes=allowed_changes(args.allow_resume_changes))


def num_training_steps(num_items: int, args: argparse.Namespace) -> int:
    """Optimizer steps the LR schedule spans (>= 1)."""
    return max(total_steps(num_items, loop_config(args)), 1)


def trainable_backend(model: torch.nn.Module, args: argparse.Namespace, dist: DistInfo,
                      num_items: int) -> FSDP2Backend:
    if args.backend != "fsdp2":
        raise UsageError(f"--backend {args.backend} is not available for this trainer; use --backend fsdp2")
    return FSDP2Backend(model, from_args(BackendConfig, args), from_args(OptimConfig, args),
                        num_training_steps=num_training_steps(num_items, args), dist=dist,
                        parallel=parallel_dims(args, dist))


def frozen_model(path: str | torch.nn.Module, args: argparse.Namespace, dist: DistInfo, flag: str,
                 offload: bool) -> FrozenModel:
    """A frozen causal LM (reference / teacher): fp32 weights cast once to the compute dtype, no LoRA.
    `path`: its directory, or the module itself (given in memory: `reference`)."""
    if isinstance(path, torch.nn.Module):
        model = path
    else:
        cfg = ModelConfig(pretrain=path, param_dtype=args.param_dtype, attn_implementation=args.attn_implementation)
        model = load_causal_lm(cfg, master_dtype="fp32", flag=flag, defer_weights=True)
    bcfg = from_args(BackendConfig, args, gradient_checkpointing=False, adam_offload=False)
    backend = FSDP2Backend(model, bcfg, None, num_training_steps=1, dist=dist, parallel=parallel_dims(args, dist))
    return FrozenModel(backend, offload=offload)


def reference(args: argparse.Namespace, given: GivenModels, dist: DistInfo) -> FrozenModel:
    """The frozen reference of DPO / KTO: the `ref` given in memory, else --ref_pretrain, else the policy: a
    frozen copy of the module given in memory (taken before training changes it), or --pretrain loaded again."""
    from rlhfkit.models.given import frozen_copy

    if given.ref is not None:
        return frozen_model(given.ref, args, dist, "--ref_pretrain", args.ref_offload)
    if args.ref_pretrain:
        return frozen_model(args.ref_pretrain, args, dist, "--ref_pretrain", args.ref_offload)
    source = frozen_copy(given.policy) if given.policy is not None else args.pretrain
    return frozen_model(source, args, dist, "--pretrain", args.ref_offload)


def train_task(task: Any, backend: Any, train_items: Sequence[Any], eval_items: Sequence[Any] | None,
               args: argparse.Namespace, dist: DistInfo, logger: Any, on_step_end: Callable | None = None,
               tokenizer: Any = None) -> LoopState:
    """The offline loop, then one evaluation at the last step if it did not end with one."""
    cfg = loop_config(args)
    cfg.data_metrics = dict(getattr(train_items, "data_metrics", {}))  # load_items: data/cut_rows
    state = train_offline(task, backend, train_items, cfg, dist, logger, eval_items, on_step_end=on_step_end,
                          tokenizer=tokenizer)
    last = state.history[-1] if state.history else {}
    if eval_items and not (last.get("step") == state.step and has_eval(last)):
        metrics = evaluate(task, backend, eval_items, args.micro_train_batch_size, dist)
        state.history.append(metrics_record(state.step, metrics))
        logger.log(state.step, metrics, console=True)
    return state


def train_policy(args: argparse.Namespace, dist: DistInfo, tokenizer: Any, task: Any, train_items: Sequence[Any],
                 eval_items: Sequence[Any] | None, plot_keys: tuple[str, ...] | None = None,
                 on_step_end: Callable | None = None, given: GivenModels = NONE) -> OfflineRun:
    """Load --pretrain as the trained causal LM (or train the policy `given` in memory itself), run the loop
    with `task`, save it, and report.

    `on_step_end(state, metrics, backend)` runs after every step; returning True stops early.
    """
    from rlhfkit.cli.common import make_logger

    cfg = from_args(ModelConfig, args)
    model = (adopt_causal_lm(given.policy, cfg) if given.policy is not None
             else load_causal_lm(cfg, master_dtype="fp32", defer_weights=True))
    backend = trainable_backend(model, args, dist, len(train_items))
    logger = make_logger(args, dist.rank, plot_keys=plot_keys)
    hook = (lambda state, metrics: on_step_end(state, metrics, backend)) if on_step_end else None
    state = train_task(task, backend, train_items, eval_items, args, dist, logger, on_step_end=hook,
                       tokenizer=tokenizer)
    save_model(args, backend, tokenizer, dist, logger, trainer=task_kind(task), state=state)
    logger.close()
    return OfflineRun(state, backend, task, tokenizer, train_items, eval_items)


def save_model(args: argparse.Namespace, backend: Any, tokenizer: Any, dist: DistInfo, logger: Any = None,
               trainer: str | None = None, state: LoopState | None = None) -> None:
    """Save in Hugging Face format to --save_path, with a model card from the run's files (`logger`).
    Too little space there: the trained state is saved as a resumable checkpoint instead, if it fits
    (`save_or_fall_back`)."""
    fallback = (lambda: save_resumable(backend, loop_config(args), state)) if state is not None else None
    save_or_fall_back(lambda: backend.save_hf(args.save_path, tokenizer), fallback)
    if logger is not None:
        logger.model_card(args.save_path, trainer=trainer)
    if dist.rank == 0:
        log.info(f"model saved to {args.save_path}")

