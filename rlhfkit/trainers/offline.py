"""The offline training loop shared by SFT, reward models, DPO, KTO, PRM and distillation.

One loop, many tasks. A task knows how to collate items, count its loss units and compute a
loss; the loop owns batching, gradient accumulation, logging, evaluation and checkpoints:

    dataset items --sampler(epoch, seed)--> global batch of `train_batch_size`
        -> this dp rank's share (tp / cp ranks of one dp rank share it), split into
           micro-batches of `micro_train_batch_size`
        -> count = all_reduce_dp(sum task.count(micro))       (global loss denominator)
        -> for each micro: loss = task.loss(micro, count)
                           (+ --aux_loss_coef x the MoE router loss, rlhfkit.losses.aux)
                           backend.backward(loss)
        -> backend.optimizer_step()  -> log / eval / checkpoint (--save_steps: resumable
           checkpoint unless --disable_ds_ckpt, HF snapshot `<ckpt_path>/global_step<N>_hf`
           with --save_hf_ckpt)

Dividing every micro-batch loss by the *global* count makes the update independent of
micro-batching and of the number of ranks. The step's metrics (already divided by that count)
are summed over dp: over the loss group for a task whose loss is a sum over tokens
(`TOKEN_ADDITIVE`), which is the dp group, as the cp ranks of context parallelism gather their
per-token outputs and each compute the whole loss (parallel/context_parallel.py).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol, Sequence

import torch
from rlhfkit.config.configs import BackendFlags, BatchConfig, CheckpointFlags, LoggingFlags, ModelFlags
from rlhfkit.config.declare import default_of
from rlhfkit.backend.base import TrainBackend
from rlhfkit.checkpoint.layout import checkpoint_gap
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config.notes import note_once
from rlhfkit.fileio import NoSpaceError
from rlhfkit.losses.aux import router_aux_loss
from rlhfkit.losses.reduce import HostValues, MicroMetrics
from rlhfkit.models.moe import RouterAuxLoss
from rlhfkit.trainers.metrics import EVAL, MetricsLogger, NullLogger, metrics_record, progress_bar
from rlhfkit.trainers.model_card import task_kind
from rlhfkit.trainers.run_settings import check_same_run
from rlhfkit.trainers.stop import StepAbandoned
from rlhfkit.trainers.stop import current as stop_signals

log = logging.getLogger(__name__)


class OfflineTask(Protocol):
    """What a paradigm (SFT, RM, DPO, ...) plugs into the loop."""

    TOKEN_ADDITIVE: ClassVar[bool]  # its loss is a sum over tokens (module docstring)

    def collate(self, items: Sequence[Any]) -> Any: ...

    def count(self, batch: Any) -> float:
        """Loss units in `batch` (tokens or samples); summed over the whole step for normalisation."""
        ...

    def loss(self, model: torch.nn.Module, batch: Any, global_count: float) -> tuple[torch.Tensor, MicroMetrics]:
        """The micro-batch's loss over `global_count` and its metrics (device tensors are read after the step)."""
        ...

    def eval_metrics(self, model: torch.nn.Module, batches: list[Any]) -> dict[str, float]: ...


@dataclass
class LoopConfig:
    train_batch_size: int
    micro_train_batch_size: int
    max_epochs: int = 1
    seed: int = default_of(BackendFlags, "seed")
    logging_steps: int = default_of(LoggingFlags, "logging_steps")
    eval_steps: int = default_of(LoggingFlags, "eval_steps")  # -1: at the end of every epoch
    save_steps: int = default_of(CheckpointFlags, "save_steps")
    ckpt_path: str = "./ckpt/checkpoints"
    max_ckpt_num: int = default_of(CheckpointFlags, "max_ckpt_num")
    load_checkpoint: bool = default_of(CheckpointFlags, "load_checkpoint")
    show_progress: bool = True
    # optimizer steps, cycling the data; overrides max_epochs
    max_steps: int | None = default_of(BatchConfig, "max_steps")
    aux_loss_coef: float = default_of(ModelFlags, "aux_loss_coef")  # MoE router balance loss weight
    save_ds: bool = True  # --save_steps writes resumable checkpoints [not --disable_ds_ckpt]
    save_hf: bool = False  # ... and Hugging Face snapshots [--save_hf_ckpt]
    # what makes the run this run (rlhfkit.trainers.run_settings), recorded in each checkpoint and
    # compared on resume; the settings accepted as changed [--allow_resume_changes]
    run_settings: dict[str, Any] = field(default_factory=dict)
    allowed_changes: frozenset[str] = frozenset()
    # constants logged with every step: what reading the data cut (data/cut_rows, rlhfkit.cli.offline_common)
    data_metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max_steps must be >= 1, got {self.max_steps}")


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # global batches of `epoch` already consumed
    history: list[dict[str, float]] = field(default_factory=list)


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    """The sample order of one epoch: a permutation seeded by (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def steps_per_epoch(n: int, train_batch_size: int) -> int:
    return n // train_batch_size


def total_steps(n: int, cfg: LoopConfig) -> int:
    """Optimizer steps of the run: --max_steps when given (the data cycled as often as needed, as in
    Hugging Face's Trainer), else --max_epochs passes over `n` samples."""
    return cfg.max_steps if cfg.max_steps is not None else steps_per_epoch(n, cfg.train_batch_size) * cfg.max_epochs


def rank_share(global_idx: list[int], dist: DistInfo) -> list[int]:
    """This data-parallel rank's contiguous share of a global batch."""
    per = len(global_idx) // dist.dp_size
    return global_idx[dist.dp_rank * per:(dist.dp_rank + 1) * per]


def train_offline(task: OfflineTask, backend: TrainBackend, train_items: Sequence[Any], cfg: LoopConfig, dist: DistInfo,
                  logger: MetricsLogger | NullLogger, eval_items: Sequence[Any] | None = None,
                  on_step_end=None, tokenizer: Any = None) -> LoopState:
    """Run the loop; returns the final state (history holds every logged record, as in metrics.jsonl).

    `on_step_end(state, metrics)` runs after every optimizer step; returning True ends training
    there (early stopping), after which the caller saves as usual. `tokenizer` goes into the
    --save_hf_ckpt snapshots.
    """
    n = len(train_items)
    spe = steps_per_epoch(n, cfg.train_batch_size)
    if spe == 0:
        raise ValueError(f"the dataset has {n} samples, fewer than --train_batch_size ({cfg.train_batch_size})")
    accum = _grad_accum(cfg, dist)
    task_dist = getattr(task, "dist", dist)
    if task_dist.dp_size != dist.dp_size:
        raise ValueError(f"the task was built for {task_dist.dp_size} data-parallel ranks, the loop runs on "
                         f"{dist.dp_size}: pass the loop's DistInfo to the task (dist=...)")
    state = LoopState()
    if cfg.load_checkpoint:
        client = backend.load_checkpoint(cfg.ckpt_path)
        if client is not None:
            check_same_run(client.get("run_settings"), cfg.run_settings, cfg.allowed_changes,
                           f"the checkpoint in --ckpt_path {cfg.ckpt_path}")
            state.step, state.epoch, state.batch_in_epoch = client["step"], client["epoch"], client["batch_in_epoch"]
            if dist.rank == 0:
                log.info(f"resumed from {cfg.ckpt_path} at step {state.step} (epoch {state.epoch})")
        logger.truncate(state.step if client is not None else -1)  # no step logged twice
    total = total_steps(n, cfg)
    if cfg.max_steps is not None and total > spe * cfg.max_epochs and dist.rank == 0:
        log.info(f"--max_steps {total}: {total / spe:.3g} passes over the data (the samples are cycled; "
                 f"--max_epochs {cfg.max_epochs} would give {spe * cfg.max_epochs} steps)")
    bar = progress_bar(total, state.step, "train", cfg.show_progress and dist.rank == 0)
    logger.start(state.step)
    done = state.step >= total
    signals = stop_signals()  # SIGINT / SIGTERM: a checkpoint after this step, then RunStopped (trainers/stop.py)
    signals.start_training()
    while not done:
        order = epoch_order(n, state.epoch, cfg.seed)
        for b in range(state.batch_in_epoch, spe):
            idx = rank_share(order[b * cfg.train_batch_size:(b + 1) * cfg.train_batch_size], dist)
            micro = [task.collate([train_items[i] for i in idx[j:j + cfg.micro_train_batch_size]])
                     for j in range(0, len(idx), cfg.micro_train_batch_size)]
            assert len(micro) == accum
            t0 = time.time()
            try:
                with signals.step():
                    metrics = _train_step(task, backend, micro, dist, cfg.aux_loss_coef)
            except StepAbandoned:
                raise signals.stop(state.step, lambda: save_resumable(backend, cfg, state), abandoned=True) from None
            state.step += 1
            state.batch_in_epoch = b + 1
            metrics["step_time"] = time.time() - t0
            metrics["epoch"] = state.epoch
            metrics.update(cfg.data_metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}")
            last_of_epoch = b + 1 == spe
            if eval_items and (_due(state.step, cfg.eval_steps) or (cfg.eval_steps < 0 and last_of_epoch)):
                metrics.update(evaluate(task, backend, eval_items, cfg.micro_train_batch_size, dist))
            if state.step % max(cfg.logging_steps, 1) == 0 or has_eval(metrics):
                state.history.append(metrics_record(state.step, metrics))
                logger.log(state.step, metrics, total=total)  # its line above the bar, if any
            if _due(state.step, cfg.save_steps) and cfg.save_ds:
                warn_if_no_space(lambda: save_resumable(backend, cfg, state, last_of_epoch), state.step)
            if _due(state.step, cfg.save_steps) and cfg.save_hf:
                snapshot = os.path.join(cfg.ckpt_path, f"global_step{state.step}_hf")
                if warn_if_no_space(lambda: backend.save_hf(snapshot, tokenizer), state.step):
                    logger.model_card(snapshot, step=state.step, trainer=task_kind(task))
            stop = on_step_end(state, metrics) if on_step_end is not None else False
            if stop and state.step < total and dist.rank == 0:
                log.info(f"stopped at step {state.step} of {total}: on_step_end returned True")
            if state.step >= total or stop:
                done = True
                break
            if signals.requested(dist.agree if dist.world_size > 1 else None):
                raise signals.stop(state.step, lambda: save_resumable(backend, cfg, state, last_of_epoch),
                                   abandoned=False)
        if not done:
            state.epoch += 1
            state.batch_in_epoch = 0
    signals.end_training()
    bar.close()
    return state


def save_resumable(backend: TrainBackend, cfg: LoopConfig, state: LoopState, last_of_epoch: bool = False) -> str:
    """A resumable checkpoint of `state` as `<ckpt_path>/global_step<N>` (all ranks call; one of this
    step already there is kept); its path."""
    existing = os.path.join(cfg.ckpt_path, f"global_step{state.step}")
    if os.path.isdir(existing) and checkpoint_gap(existing) is None:
        return existing
    ep, bi = (state.epoch + 1, 0) if last_of_epoch else (state.epoch, state.batch_in_epoch)
    return backend.save_checkpoint(cfg.ckpt_path, f"global_step{state.step}",
                                   {"step": state.step, "epoch": ep, "batch_in_epoch": bi,
                                    "run_settings": cfg.run_settings}, cfg.max_ckpt_num)


def warn_if_no_space(save: Callable[[], Any], step: int) -> bool:
    """Run `save`; when the disk is too full for it, one warning line and False (the run goes on with
    the checkpoints it has; the save removed its own partial files)."""
    try:
        save()
    except NoSpaceError as e:
        print(f"warning: step {step}: not saved: {e}; the checkpoints saved before are kept", file=sys.stderr,
              flush=True)
        return False
    return True


def has_eval(metrics: dict[str, Any]) -> bool:
    return any(k.startswith(EVAL) for k in metrics)


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _grad_accum(cfg: LoopConfig, dist: DistInfo) -> int:
    per = cfg.micro_train_batch_size * dist.dp_size
    what = "world size" if dist.dp_size == dist.world_size else "data-parallel size"
    if cfg.train_batch_size % per != 0:
        raise ValueError(
            f"--train_batch_size ({cfg.train_batch_size}) must be a multiple of --micro_train_batch_size "
            f"({cfg.micro_train_batch_size}) x {what} ({dist.dp_size}) = {per}")
    return cfg.train_batch_size // per


def _train_step(task: OfflineTask, backend: TrainBackend, micro: list[Any], dist: DistInfo,
                aux_loss_coef: float = 0.0) -> dict[str, float]:
    backend.train()
    counts = [float(task.count(mb)) for mb in micro]  # of whole rows: summed over dp
    global_count = float(dist.all_reduce_dp(torch.tensor(sum(counts), dtype=torch.float64)).item())
    if global_count <= 0:
        raise ValueError("an optimizer step has no loss tokens: every sample was fully masked/truncated "
                         "(check --max_len and the data)")
    sums: dict[str, torch.Tensor | float] = {}  # a task's metric may be a device tensor: no sync per micro-batch
    for i, mb in enumerate(micro):
        with RouterAuxLoss(backend.model, enabled=aux_loss_coef != 0) as router:
            loss, m = task.loss(backend.model, mb, global_count)
        aux = router.take()
        if aux is not None:
            aux_l, aux_m = router_aux_loss(aux, aux_loss_coef, counts[i], global_count)
            loss, m = loss + aux_l, {**m, **aux_m}
        elif aux_loss_coef:
            note_once("note: --aux_loss_coef has no effect: the trained model returns no router load-balancing "
                      "loss (not a mixture-of-experts causal LM)")
        backend.backward(loss, sync_grads=i == len(micro) - 1)
        for k, v in m.items():
            v = v.detach().double() if isinstance(v, torch.Tensor) else float(v)
            sums[k] = sums.get(k, 0.0) + v
    # read after the optimizer step's own sync, so the GPU is not drained one more time per step
    pending = HostValues(sums)
    stop_signals().commit()  # from here the step changes the weights: it is never abandoned
    stepped = backend.optimizer_step()
    # task metrics are already normalised by the global count: sum them over micro-batches and ranks
    host = pending.result()
    keys = sorted(host)
    vec = torch.tensor([host[k] for k in keys], dtype=torch.float64)
    vec = dist.all_reduce_loss(vec) if task.TOKEN_ADDITIVE else dist.all_reduce_dp(vec)
    out = {k: float(v) for k, v in zip(keys, vec.tolist())}
    out.update(stepped)
    return out


@torch.no_grad()
def evaluate(task: OfflineTask, backend: TrainBackend, items: Sequence[Any], micro_batch_size: int, dist: DistInfo
             ) -> dict[str, float]:
    """Eval metrics ("eval/<name>", as the task names them) over this rank's share of `items` (the task
    reduces across ranks).

    Every dp rank gets ceil(len(items) / dp) items, wrapping around as torch's DistributedSampler
    does (up to dp - 1 items are seen twice), so all ranks run the same number of forward
    passes: sharded models need that to stay in step.
    """
    backend.eval()
    per = -(-len(items) // dist.dp_size)
    share = [(dist.dp_rank + k * dist.dp_size) % len(items) for k in range(per)]
    batches = [task.collate([items[i] for i in share[j:j + micro_batch_size]])
               for j in range(0, len(share), micro_batch_size)]
    out = task.eval_metrics(backend.model, batches)
    backend.train()
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}
