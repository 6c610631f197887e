"""Non-finite guard of the optimizer step (`--max_nonfinite_steps`, default 3).

    backward(loss):   note_loss(loss)            a device-side flag, no host sync
    optimizer_step(): grad norm (global) -> decide(norm)
                        one host transfer of [norm non-finite, loss non-finite, the previous step's
                        weights non-finite, norm], one collective over the ranks for the flags
                        -> every rank takes the same decision
                      finite:     clip, step ... -> check_weights_later(params): one max|w| per tensor
                                  into a device-side flag, read with the next decision
                      non-finite: the step is skipped (weights, optimizer state and LR schedule
                                  unchanged), `nonfinite_skipped` = 1; more than `limit` skips in a
                                  row raise NonFiniteError

A step that makes a weight non-finite raises NonFiniteError at the next of: the next optimizer step's
decision (before that step changes anything), `resolve()` (the backend calls it before weights leave
for an engine or a file), `check_finite` before a save. So the run ends before any checkpoint, model
or engine gets the ruined weights (the CLIs print the message as one line and exit 1), and the
message names the step that made them. Under fp16 a skipped step whose loss was finite is the
dynamic loss scale overflowing, which the scaler handles (halving the scale): it is counted only
once the scale sits at its minimum.

Cost per optimizer step: one infinity-norm pass over the local weights (`torch._foreach_norm`, NaN
propagates through the max), one 3-float all-reduce (sharded runs), and one host sync, for the
decision. The weight check does not wait for the GPU: the host goes on to the next step while the
optimizer's kernels run.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from rlhfkit.parallel import dist as D

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
        self._pending: tuple[torch.Tensor, Sequence[tuple[str, torch.Tensor]], str] | None = None

    def note_loss(self, loss: torch.Tensor) -> None:
        """Remember whether a micro-batch loss was non-finite (no host sync)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def decide(self, grad_norm: torch.Tensor) -> tuple[bool, bool, float]:
        """(step is finite, the loss was non-finite on some rank, the grad norm as a float); the same on
        every rank. Raises NonFiniteError first if the previous step left a non-finite weight."""
        return self.decide_host(self.device_flags(grad_norm).cpu())

    def device_flags(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """[norm non-finite, a loss non-finite, the previous step left a non-finite weight, norm] (float64)
        on the norm's device, without a host sync; `decide_host` takes them once they are on the host."""
        norm = grad_norm.detach().float().reshape(())
        dev = norm.device
        loss_bad = self._loss_bad.to(dev) if self._loss_bad is not None else torch.zeros((), dtype=torch.bool, device=dev)
        self._loss_bad = None
        weights_bad = self._pending[0].to(dev) if self._pending is not None else torch.zeros((), dtype=torch.bool,
                                                                                             device=dev)
        return torch.stack([(~torch.isfinite(norm)).double(), loss_bad.double(), weights_bad.double(), norm.double()])

    def decide_host(self, host: torch.Tensor) -> tuple[bool, bool, float]:
        """`decide` from `device_flags` copied to the host (reduced over the ranks here)."""
        norm_bad, any_loss_bad, any_weights_bad = _reduce_any(host[:3])
        if any_weights_bad:
            self._raise_pending()
        self._pending = None
        self.steps += 1
        return not (norm_bad or any_loss_bad), any_loss_bad, float(host[3])

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
        self.check_weights_later(named, what)
        self.resolve()

    def check_weights_later(self, named: Sequence[tuple[str, torch.Tensor]], what: str,
                            flag: torch.Tensor | None = None) -> None:
        """`check_weights` without waiting: the flag stays on the device until the next `decide` or
        `resolve` reads it (all ranks call). `flag`: one computed already (non-zero: a weight is
        non-finite), e.g. by the fused optimizer step as it wrote the weights."""
        self._pending = (self._local_flag(named) if flag is None else flag, named, what)

    def resolve(self) -> None:
        """Read a pending weight check now: raise NonFiniteError if it found a non-finite weight on
        any rank (all ranks call)."""
        if self._pending is None:
            return
        if _reduce_any(torch.tensor([float(bool(self._pending[0]))]))[0]:
            self._raise_pending()
        self._pending = None

    @staticmethod
    def _local_flag(named: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
        norms = local_max_abs([t for _, t in named])
        if not norms:
            return torch.zeros((), dtype=torch.bool)
        return ~torch.isfinite(torch.stack(norms)).all()

    def _raise_pending(self) -> None:
        assert self._pending is not None
        flag, named, what = self._pending
        self._pending = None
        name = first_nonfinite(named) if bool(flag) else None
        where = f" ({name})" if name else ""
        raise NonFiniteError(f"non-finite weights{where} {what}: stopping without saving; "
                             "lower the learning rate (or --max_norm) and resume from a checkpoint")
