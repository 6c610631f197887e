"""Shared CLI plumbing: error reporting, seeding, run directory, metrics logger.

`cli_main(fn)` ends a run stopped by SIGINT / SIGTERM (rlhfkit.trainers.stop.RunStopped) with its one
line and exit code 130 / 143, and turns the errors a user can cause (bad data, bad flags, missing files or hub models, a
missing optional package, a learning rate that makes the weights non-finite, a failing reward_func
under `--reward_failure stop`, `--max_failed_steps` steps without a trajectory) into one clear line on
stderr and exit code 1, instead of a traceback; set `RLHFKIT_TRACEBACK=1` to see the traceback anyway.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np
import torch

from rlhfkit import logs
from rlhfkit.config.errors import UsageError  # noqa: F401 (every command raises it from here)
from rlhfkit.backend.guard import DivergenceError
from rlhfkit.config.flag_parser import set_explicitly
from rlhfkit.config.flags import run_dir_of, write_resolved_config
from rlhfkit.config.notes import note_once
from rlhfkit.data.io import DataError
from rlhfkit.optional import MissingPackageError, require
from rlhfkit.redact import redact_config
from rlhfkit.trainers.metrics import MetricsLogger, NullLogger, WandbSettings, tensorboard_run_dir

if TYPE_CHECKING:
    from rlhfkit.parallel.dist import DistInfo
    from rlhfkit.parallel.mesh import ParallelDims


T = TypeVar("T")
log = logging.getLogger(__name__)


def _run_failures() -> tuple[type[BaseException], ...]:
    """Errors that end a run for a reason the user must act on (imported late: agents, trainers)."""
    from rlhfkit.agents.base import RewardFailure
    from rlhfkit.usercode.files import UserFileError
    from rlhfkit.fileio import NoSpaceError
    from rlhfkit.roles.memory import RoleOutOfMemory
    from rlhfkit.trainers.rl import FailedStepsError

    return RewardFailure, FailedStepsError, NoSpaceError, UserFileError, RoleOutOfMemory


def cli_main(prog: str, fn: Callable[[], T]) -> T:
    """Run `fn` and return its result; a user error becomes one line on stderr (with the frames of the
    user's own code under it, when it came from there) and exit code 1. The full traceback goes to the
    run's log file (rlhfkit.logs) either way. SIGINT / SIGTERM end it with the checkpoint and the resume
    command, exit 130 / 143."""
    logs.route_transformers()  # its log records too go through rlhfkit's console handler and log file
    from rlhfkit.trainers.stop import RunStopped

    try:
        return fn()
    except RunStopped as e:  # SIGINT / SIGTERM: the checkpoint and the resume command, exit 130 / 143
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
    except Exception as e:
        log.debug("%s failed", prog, exc_info=e)
        if not isinstance(e, (DataError, UsageError, FileNotFoundError, ValueError, DivergenceError,
                              MissingPackageError) + _run_failures()):
            raise
        if os.environ.get("RLHFKIT_TRACEBACK"):
            traceback.print_exc()
        log.error("\n".join(logs.user_error_lines(prog, e)))
        raise SystemExit(1)
    finally:
        logs.close_run_logs()


def model_positions(model: str | torch.nn.Module | None) -> int | None:
    """max_position_embeddings of the local model directory (or the module given in memory) `model`
    (None when unknown)."""
    config = _config_of(model)
    n = getattr(config, "max_position_embeddings", None) if config is not None else None
    return n if isinstance(n, int) and n > 0 else None


def check_positions(model: str | torch.nn.Module | None, length: int, what: str, flag: str = "--pretrain") -> None:
    """`length` tokens (`what` names the flags that give it) must fit the positions of `model` (a directory or
    a module given in memory)."""
    limit = model_positions(model)
    if limit is not None and length > limit:
        where = f"{flag} {model}" if isinstance(model, str) else f"the {flag} module"
        raise UsageError(f"{what} exceeds the model's max_position_embeddings {limit} ({where}); lower it")


def note_cpu_dtype(args: argparse.Namespace, device: str | None) -> None:
    """One line when --param_dtype (given, not left at its default) asks a CPU run for low precision:
    CPU training computes in fp32 (rlhfkit.backend.precision)."""
    dtype = getattr(args, "param_dtype", "fp32")
    if dtype != "fp32" and str(device or "cpu").startswith("cpu") and set_explicitly(args, "param_dtype"):
        note_once(f"note: --param_dtype {dtype} has no effect on CPU: training computes in fp32 (low-precision "
                  "CPU compute is slow)")


def disable_hf_progress_bars() -> None:
    """`--disable_progress` also silences the weight-loading bars of transformers (on stderr)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def set_seed(seed: int, full_determinism: bool = False) -> None:
    """Seed python, numpy and torch; `--full_determinism` also makes torch pick deterministic
    algorithms (transformers.enable_full_determinism: cuDNN / cuBLAS settings, deterministic
    flash-attention backward). Ops without a deterministic kernel warn instead of failing."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if full_determinism:
        from transformers import enable_full_determinism

        enable_full_determinism(seed, warn_only=True)


MODEL_PATH_FLAGS = ("pretrain", "ref_pretrain", "reward_pretrain", "critic_pretrain", "teacher_model")


def resolve_model_paths(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> None:
    """Every model flag (comma-separated lists too) that is not a local directory becomes one: a hub
    id is resolved through the Hugging Face cache and, when online, the hub (`rlhfkit.models.hub`;
    with --use_ms, ModelScope). Run once, early, in the process that parses the flags, so torchrun
    ranks and Ray actors load local directories and a model that cannot be had fails before anything
    starts. `skip`: the flags whose model is given in memory (rlhfkit.models.given; the flag only names
    where it came from)."""
    from rlhfkit.models.hub import resolve_model_path

    resolve_modelscope_paths(args, skip)
    for dest in (d for d in MODEL_PATH_FLAGS if d not in skip):
        value = getattr(args, dest, None)
        if value:
            flag = "--" + dest
            setattr(args, dest, ",".join(resolve_model_path(p, flag) if p else p for p in value.split(",")))


def resolve_modelscope_paths(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> None:
    """--use_ms: model ids that are not local directories are downloaded from ModelScope, and the
    flags then name the downloaded directories (so every process, Ray actors included, loads those)."""
    if not getattr(args, "use_ms", False):
        return
    remote = [d for d in MODEL_PATH_FLAGS if getattr(args, d, None) and d not in skip
              for p in getattr(args, d).split(",") if p and not os.path.isdir(p)]
    if not remote:
        log.info("note: --use_ms has no effect: every model path is a local directory")
        return
    snapshot_download = require("modelscope", "--use_ms (downloads from ModelScope)").snapshot_download
    for d in dict.fromkeys(remote):
        parts = [p if not p or os.path.isdir(p) else snapshot_download(p) for p in getattr(args, d).split(",")]
        setattr(args, d, ",".join(parts))


def _config_of(path: str | torch.nn.Module | None) -> Any:
    """The transformers config of the local model directory `path`, or of a module given in memory (None
    when there is none to read)."""
    if isinstance(path, torch.nn.Module):
        return getattr(path, "config", None)
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception:  # noqa: BLE001 - an unreadable config is reported where the model is loaded
        return None


def _rank0_line(line: str) -> None:
    """One line of this run (every run of a process says it: not `note_once`), from rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        log.info(line)


def resolve_rollout_engine(args: argparse.Namespace, max_model_len: int | None, pictures: bool = False,
                           model: str | torch.nn.Module | None = None) -> None:
    """--rollout_engine, resolved once for --pretrain (rlhfkit.rollout.choice; auto: builtin when it
    can run the model, else vllm when installed, else hf) before any model loads: the flag then names
    the engine that runs, which every later check and the Ray engine actors read. A fallback of auto
    is announced in one line; an explicit builtin the model cannot use is an error naming the flag.
    `model`: the policy given in memory, read instead of --pretrain."""
    from rlhfkit.rollout.choice import choose_engine

    choice = choose_engine(args.rollout_engine, model if model is not None else args.pretrain,
                           max_model_len=max_model_len, pictures=pictures)
    if choice.fell_back:
        _rank0_line(choice.describe())
    args.rollout_engine = choice.name


def check_packing(args: argparse.Namespace, *models: tuple[str, str | torch.nn.Module | None]) -> None:
    """--packing_samples with a model whose layers carry a state along the sequence (linear attention,
    state-space: rlhfkit.models.forward.packing_refusal) would mix packed samples: such a run trains
    padded, and one line says so. `models`: (flag, local model directory or module given in memory) of each
    model that packs."""
    from rlhfkit.models.forward import packing_refusal

    if not args.packing_samples:
        return
    for flag, path in models:
        config = _config_of(path)
        why = packing_refusal(config) if config is not None else None
        if why is not None:
            where = f"{flag} {path}" if not isinstance(path, torch.nn.Module) else f"the {flag} module"
            _rank0_line(f"note: --packing_samples is off for this run: {where}: {why}; samples run padded")
            args.packing_samples = False
            return


# flag (dest) -> (package, what the message calls the feature) for `check_packages`
FLAG_PACKAGES = (("lora_rank", "peft", "--lora_rank"), ("load_in_4bit", "bitsandbytes", "--load_in_4bit"),
                 ("use_tensorboard", "tensorboard", "--use_tensorboard"), ("use_wandb", "wandb", "--use_wandb"))


def check_packages(args: argparse.Namespace) -> None:
    """The optional packages the flags ask for are installed (else one line with the pip command),
    checked before any model is loaded."""
    for dest, module, feature in FLAG_PACKAGES:
        if getattr(args, dest, None):
            require(module, feature)


def make_logger(args: argparse.Namespace, rank: int, plot_keys: tuple[str, ...] | None = None):
    """The run's metrics logger (rank 0) after writing the resolved config; NullLogger elsewhere."""
    if rank != 0:
        return NullLogger()
    run_dir = run_dir_of(args)
    write_resolved_config(args, run_dir)
    logs.add_run_log(run_dir)
    wandb = None
    if getattr(args, "use_wandb", None):
        wandb = WandbSettings(key=args.use_wandb, project=args.wandb_project, org=args.wandb_org,
                              group=args.wandb_group, run_name=args.wandb_run_name)
    tb = tensorboard_run_dir(args.use_tensorboard, args.wandb_run_name, run_dir) if args.use_tensorboard else None
    return MetricsLogger(run_dir, tensorboard_dir=tb, wandb=wandb,
                         config=redact_config({k: v for k, v in vars(args).items() if k != "use_wandb"}),
                         plot_keys=plot_keys)




def save_or_fall_back(save: Callable[[], None], fallback: Callable[[], str] | None) -> None:
    """The final save; when its disk is too full (NoSpaceError, partial files removed), `fallback()`
    writes the trained state as a resumable checkpoint and the run ends with one line naming both
    (exit 1): the trained steps are never lost to a full disk while some other disk has room. When the
    fallback cannot complete either, the line names the last good checkpoint to go on from."""
    from rlhfkit.checkpoint.errors import CheckpointSaveError
    from rlhfkit.checkpoint.layout import last_good_checkpoint
    from rlhfkit.fileio import NoSpaceError

    try:
        save()
    except NoSpaceError as e:
        if fallback is None:
            raise
        try:
            where = fallback()
        except (NoSpaceError, CheckpointSaveError) as e2:
            root = e2.path if isinstance(e2, NoSpaceError) else e2.root
            raise NoSpaceError(e.path, e.need, e.have, note=f"the resumable checkpoint was not saved either: {e2}; "
                               f"{last_good_checkpoint(root)}") from e
        raise NoSpaceError(e.path, e.need, e.have, note=f"the trained state is saved as the resumable checkpoint "
                           f"{where} instead: free space, then run the same command with --load_checkpoint "
                           "to write the model") from e


def report_dropped(ds: Any, rows_read: int, what: str, training: bool) -> None:
    """Count and name the rows the tokenized dataset `ds` left out, and those it kept but cut at --max_len,
    once, on rank 0; a training set left with fewer than half its rows, or none, is a DataError
    (rlhfkit.data.items.check_dropped, check_cut)."""
    from rlhfkit.data.items import check_cut, check_dropped

    lines = [check_dropped(ds, rows_read, what, training=training), check_cut(ds, rows_read, what)]
    if os.environ.get("RANK", "0") == "0":
        for line in filter(None, lines):
            log.info(line)


def parallel_dims(args: argparse.Namespace, dist: DistInfo) -> ParallelDims:
    """The training mesh of this process group, from --zero_stage, --ds_tensor_parallel_size and
    --ring_attn_size (handed to every FSDP2Backend of the group)."""
    from rlhfkit.parallel.mesh import ParallelDims

    return ParallelDims.from_flags(dist.world_size, getattr(args, "zero_stage", 2),
                                   tensor_parallel_size=getattr(args, "ds_tensor_parallel_size", 1),
                                   ring_attn_size=getattr(args, "ring_attn_size", 1))


def check_backend_flags(args: argparse.Namespace) -> None:
    """Refuse parallelism we do not implement. (DeepSpeed-only flags are declared `inert` in
    rlhfkit.config.flags: parsing prints a note for each one set.)"""
    if getattr(args, "ring_attn_size", 1) < 1:
        raise UsageError(f"--ring_attn_size must be >= 1, got {args.ring_attn_size}")
    if getattr(args, "ring_head_stride", 1) < 1:
        raise UsageError(f"--ring_head_stride must be >= 1, got {args.ring_head_stride}")
    if getattr(args, "ds_tensor_parallel_size", 1) < 1:
        raise UsageError(f"--ds_tensor_parallel_size must be >= 1, got {args.ds_tensor_parallel_size}")
    if getattr(args, "backend", "fsdp2") != "fsdp2":
        raise UsageError(f"--backend {args.backend} is not available yet; use --backend fsdp2")
