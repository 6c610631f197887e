"""Non-finite guard of the optimizer step (`--max_nonfinite_steps`, default 3).

    backward(loss):   note_loss(loss)            a device-side flag, no host sync
    optimizer_step(): grad norm (global) -> decide(norm)
                        one collective over the ranks: [norm non-finite, some rank's loss non-finite]
                        -> every rank takes the same decision
                      finite:     clip, step ... -> check_weights(params): one max|w| per tensor,
                                  reduced over the ranks; a non-finite weight raises NonFiniteError
                      non-finite: the step is skipped (weights, optimizer state and LR schedule
                                  unchanged), `nonfinite_skipped` = 1; more than `limit` skips in a
                                  row raise NonFiniteError

The error ends the run before any checkpoint or model is written from the ruined weights (the
CLIs print its message as one line and exit 1), and `check_finite` refuses to save non-finite
weights in any case. Under fp16 a skipped step whose loss was finite is the dynamic loss scale
overflowing, which the scaler handles (halving the scale): it is counted only once the scale
sits at its minimum.

Cost per optimizer step: one 2-float all-reduce (sharded runs), one infinity-norm pass over the
local weights (`torch._foreach_norm`, NaN propagates through the max) and one 1-float
all-reduce; the host syncs once for the decision and once for the weight check.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from rlhfkit.backend import dist as D

log = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]


class NonFiniteError(RuntimeError):
    """Training produced non-finite numbers it cannot go on from; the run must stop unsaved."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _reduce_any(flags: torch.Tensor) -> list[bool]:
    """Element-wise "true on some rank" of a float vector of 0/1 flags."""
    return [v > 0 for v in D.all_reduce_sum(flags.double()).tolist()]


def local_max_abs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """max |t| of each non-empty local tensor (NaN when it holds a NaN), as 0-d tensors."""
    local = [_local(t.detach()) for t in tensors]
    local = [t for t in local if t.numel()]
    if not local:
        return []
    return [n.float() for n in torch._foreach_norm(local, float("inf"))]


def first_nonfinite(named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first tensor holding a NaN or an infinity on this rank (error path only)."""
    for name, t in named:
        t = _local(t.detach())
        if t.numel() and not bool(torch.isfinite(t).all()):
            return name
    return None


class NonFiniteGuard:
    """Counts skipped optimizer steps and stops the run; see the module docstring."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"--max_nonfinite_steps must be >= 0, got {limit}")
        self.limit = limit
        self.in_a_row = 0
        self.skipped = 0
        self.steps = 0
        self._loss_bad: torch.Tensor | None = None

    def note_loss(self, loss: torch.Tensor) -> None:
        """Remember whether a micro-batch loss was non-finite (no host sync)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def decide(self, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """(step is finite, the loss was non-finite on some rank); the same on every rank."""
        loss_bad = self._loss_bad if self._loss_bad is not None else torch.zeros((), dtype=torch.bool)
        self._loss_bad = None
        flags = torch.stack([(~torch.isfinite(grad_norm.detach().float())).double().cpu(),
                             loss_bad.double().cpu()])
        norm_bad, any_loss_bad = _reduce_any(flags)
        self.steps += 1
        return not (norm_bad or any_loss_bad), any_loss_bad

    def skip(self, counts: bool, grad_norm: float, lr: float) -> None:
        """Record a skipped step; raises NonFiniteError after more than `limit` counted in a row."""
        self.skipped += 1
        if not counts:
            return
        self.in_a_row += 1
        log.warning("optimizer step %d skipped: non-finite loss or gradient (grad norm %s), %d in a row "
                    "(--max_nonfinite_steps %d)", self.steps, grad_norm, self.in_a_row, self.limit)
        if self.in_a_row > self.limit:
            raise NonFiniteError(
                f"non-finite loss or gradient in {self.in_a_row} optimizer steps in a row (more than "
                f"--max_nonfinite_steps {self.limit}; last grad norm {grad_norm}, learning rate {lr:g}): "
                "stopping without saving; lower the learning rate or check the data")

    def stepped(self) -> None:
        self.in_a_row = 0

    def check_weights(self, named: Sequence[tuple[str, torch.Tensor]], what: str) -> None:
        """Raise NonFiniteError if any weight is NaN or infinite on any rank (all ranks call)."""
        norms = local_max_abs([t for _, t in named])
        bad_here = bool(norms) and not bool(torch.isfinite(torch.stack(norms)).all())
        if not _reduce_any(torch.tensor([float(bad_here)]))[0]:
            return
        name = first_nonfinite(named) if bad_here else None
        where = f" ({name})" if name else ""
        raise NonFiniteError(f"non-finite weights{where} {what}: stopping without saving; "
                             "lower the learning rate (or --max_norm) and resume from a checkpoint")
