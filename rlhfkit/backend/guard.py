"""Guard of the optimizer step: non-finite numbers and divergence.

Non-finite (`--max_nonfinite_steps`, default 3):

    backward(loss):   note_loss(loss)            device-side flags, no host sync
    optimizer_step(): grad norm (global) -> decide(norm)
                        one host transfer of [norm non-finite, loss non-finite, the previous step's
                        weights non-finite, the previous step's weights grown too large, a loss
                        non-zero, norm], one collective over the ranks for the flags
                        -> every rank takes the same decision
                      finite:     clip, step ... -> check_weights_later(params): one max|w| per tensor
                                  into device-side flags, read with the next decision
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

Divergence: finite weights can be as ruined (a learning rate of 1e6 moves every weight by about 1e6
in one AdamW step; the network then saturates: float32 softmaxes and sigmoids at exactly 0 or 1, the
gradient exactly 0, and the run would go on to save the wreck). Two more rules, read at the same
points as the non-finite check and raising DivergenceError (NonFiniteError is a kind of it):

    weights grown   max |w| over the trainable weights above `max_weight_growth` (--max_weight_growth,
                    default 100; 0: off) x max(1, max |w| at the start of training). The same
                    per-tensor max |w| as the non-finite check, compared on the device: no extra pass
                    (except under the fused kernel of master_adamw.py, which only gives a flag). The
                    start value is measured before the first optimizer step (one host sync, once) and
                    kept in the checkpoint, so a resumed run compares with the same one.
                    Why 100: AdamW (and Muon) normalise the gradient, so a step moves a weight by about
                    the learning rate whatever the gradient: going from the start to 100x takes some
                    100 / lr steps (1e5 at lr 1e-3, 1e7 at a fine-tuning rate of 1e-5), which a healthy
                    run never makes, while a rate of 100 or more gets there in one step. An update that
                    explodes thus shows as weights that do, at the step that made it: one rule covers
                    both. Why at least 1: normalisation weights start at 1 and trained weights of a
                    normalised network are O(1), while some trainable sets start tiny (a LoRA adapter:
                    B = 0, A below 1 / sqrt(fan_in)); their limit is then 100, not 100 x 0.016.
    zero gradient   the global grad norm exactly 0.0 while a loss of the step was non-zero, in more
                    than `max_zero_grad_steps` (--max_zero_grad_steps, default 3; -1: off) optimizer
                    steps in a row, once some earlier step had a non-zero gradient. Exactly zero (not
                    small) with a non-zero loss means no signal reaches any trainable weight: the
                    saturated network above. Each such step logs a warning; the next non-zero gradient
                    or zero loss ends the row. Why those conditions: a step whose loss is exactly 0
                    has nothing to learn (every advantage of a GRPO group 0) and is not counted; one
                    PPO mini-batch whose every token is clipped has a zero gradient and a non-zero
                    loss, but the first mini-batch of each RL step has ratio 1, so a row of four needs
                    a policy that moved far out of its trust region in every later mini-batch.

Cost per optimizer step: one infinity-norm pass over the local weights (`torch._foreach_norm`, NaN
propagates through the max), one 5-float all-reduce (sharded runs), and one host sync, for the
decision. The weight check does not wait for the GPU: the host goes on to the next step while the
optimizer's kernels run.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from rlhfkit.parallel import dist as D

log = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

# the decision's vector (`device_flags`): flags first (reduced over the ranks), the grad norm last
NORM_BAD, LOSS_BAD, WEIGHTS_BAD, WEIGHTS_GROWN, LOSS_NONZERO, NORM = range(6)
NO_STEP = LOSS_NONZERO  # the flags before this one mean: apply no update


class DivergenceError(RuntimeError):
    """Training went where it cannot come back from (non-finite numbers, exploding weights, a gradient
    stuck at exactly zero); the run must stop unsaved. The message names the flag and the step."""


class NonFiniteError(DivergenceError):
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


def largest(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[float, str]:
    """(max |w|, the name of the tensor holding it) over this rank's shards (error path only)."""
    best, where = 0.0, ""
    for name, t in named:
        t = _local(t.detach())
        if t.numel():
            v = float(t.abs().max())
            if v > best:
                best, where = v, name
    return best, where


class StepGuard:
    """Skips non-finite optimizer steps and stops the run on non-finite or diverged training; see the
    module docstring."""

    def __init__(self, limit: int, max_weight_growth: float = 100.0, max_zero_grad_steps: int = 3) -> None:
        if limit < 0:
            raise ValueError(f"--max_nonfinite_steps must be >= 0, got {limit}")
        if not max_weight_growth >= 0 or (0 < max_weight_growth <= 1):
            raise ValueError(f"--max_weight_growth must be 0 (off) or above 1, got {max_weight_growth}")
        if max_zero_grad_steps < -1:
            raise ValueError(f"--max_zero_grad_steps must be >= -1 (-1: off), got {max_zero_grad_steps}")
        self.limit = limit
        self.max_weight_growth = float(max_weight_growth)
        self.max_zero_grad_steps = max_zero_grad_steps
        self.in_a_row = 0
        self.skipped = 0
        self.steps = 0
        self.start_peak: float | None = None  # max |w| before the first optimizer step (all ranks)
        self.zero_grad_in_a_row = 0
        self._had_gradient = False
        self._loss_nonzero_last = False
        self._loss_bad: torch.Tensor | None = None
        self._loss_nonzero: torch.Tensor | None = None
        # (weights non-finite, weights grown, the weights, what the step was) of the last check
        self._pending: tuple[torch.Tensor, torch.Tensor, Sequence[tuple[str, torch.Tensor]], str] | None = None

    # ------------------------------------------------------------------ the start of training

    @property
    def needs_start(self) -> bool:
        """Whether `measure_start` must run before the next optimizer step."""
        return self.max_weight_growth > 0 and self.start_peak is None

    def measure_start(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Record max |w| of the trainable weights before training changes them (all ranks call)."""
        norms = local_max_abs([t for _, t in named])
        local = float(torch.stack(norms).max()) if norms else 0.0
        self.start_peak = float(D.all_reduce_max(local))

    @property
    def weight_limit(self) -> float | None:
        """The max |w| above which the weights have diverged (None: not checked)."""
        if self.max_weight_growth <= 0 or self.start_peak is None:
            return None
        return self.max_weight_growth * max(1.0, self.start_peak)

    def state_dict(self) -> dict[str, Any]:
        return {"start_peak": self.start_peak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's start value (a checkpoint without one: measured again before the next step)."""
        self.start_peak = state.get("start_peak")

    # ------------------------------------------------------------------ each step

    def note_loss(self, loss: torch.Tensor) -> None:
        """Remember whether a micro-batch loss was non-finite, and whether it was non-zero (no host sync)."""
        loss = loss.detach()
        bad, nonzero = ~torch.isfinite(loss).all(), (loss != 0).any()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        self._loss_nonzero = nonzero if self._loss_nonzero is None else self._loss_nonzero | nonzero

    def decide(self, grad_norm: torch.Tensor) -> tuple[bool, bool, float]:
        """(step is finite, the loss was non-finite on some rank, the grad norm as a float); the same on
        every rank. Raises NonFiniteError / DivergenceError first if the previous step left non-finite
        or diverged weights."""
        return self.decide_host(self.device_flags(grad_norm).cpu())

    def device_flags(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """[norm non-finite, a loss non-finite, the previous step's weights non-finite, ... grown, a loss
        non-zero, norm] (float64; indices NORM_BAD ... NORM) on the norm's device, without a host sync;
        `decide_host` takes them once they are on the host."""
        norm = grad_norm.detach().float().reshape(())
        dev = norm.device
        no = torch.zeros((), dtype=torch.bool, device=dev)
        loss_bad = self._loss_bad.to(dev) if self._loss_bad is not None else no
        loss_nonzero = self._loss_nonzero.to(dev) if self._loss_nonzero is not None else no
        self._loss_bad = self._loss_nonzero = None
        bad, grown = (self._pending[0].to(dev), self._pending[1].to(dev)) if self._pending is not None else (no, no)
        return torch.stack([(~torch.isfinite(norm)).double(), loss_bad.double(), bad.double(), grown.double(),
                            loss_nonzero.double(), norm.double()])

    @staticmethod
    def no_step(flags: torch.Tensor) -> torch.Tensor:
        """1.0 where `device_flags` say the update must not be applied (a fused optimizer's `found_inf`)."""
        return (flags[:NO_STEP].sum() > 0).float()

    def decide_host(self, host: torch.Tensor) -> tuple[bool, bool, float]:
        """`decide` from `device_flags` copied to the host (reduced over the ranks here)."""
        norm_bad, any_loss_bad, any_weights_bad, any_grown, any_loss_nonzero = _reduce_any(host[:NORM])
        if any_weights_bad or any_grown:
            self._raise_pending(any_weights_bad)
        self._pending = None
        self.steps += 1
        self._loss_nonzero_last = any_loss_nonzero
        return not (norm_bad or any_loss_bad), any_loss_bad, float(host[NORM])

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

    def stepped(self, grad_norm: float, lr: float) -> None:
        """A finite step was taken with this global grad norm; raises DivergenceError after more than
        `max_zero_grad_steps` exactly-zero gradients in a row under a non-zero loss (module docstring)."""
        self.in_a_row = 0
        if grad_norm != 0.0:
            self._had_gradient = True
            self.zero_grad_in_a_row = 0
            return
        if self.max_zero_grad_steps < 0 or not self._had_gradient or not self._loss_nonzero_last:
            self.zero_grad_in_a_row = 0
            return
        self.zero_grad_in_a_row += 1
        log.warning("optimizer step %d: the gradient is exactly 0 while the loss is not, %d in a row "
                    "(--max_zero_grad_steps %d)", self.steps, self.zero_grad_in_a_row, self.max_zero_grad_steps)
        if self.zero_grad_in_a_row > self.max_zero_grad_steps:
            raise DivergenceError(
                f"the gradient was exactly 0 while the loss was not in {self.zero_grad_in_a_row} optimizer steps "
                f"in a row, up to step {self.steps} (more than --max_zero_grad_steps {self.max_zero_grad_steps}; "
                f"learning rate {lr:g}): the model no longer learns (saturated); stopping without saving; lower "
                "the learning rate and resume from a checkpoint saved before this")

    # ------------------------------------------------------------------ the weights

    def check_weights(self, named: Sequence[tuple[str, torch.Tensor]], what: str) -> None:
        """Raise NonFiniteError if any weight is NaN or infinite on any rank, DivergenceError if one has
        grown past the limit (all ranks call)."""
        self.check_weights_later(named, what)
        self.resolve()

    def check_weights_later(self, named: Sequence[tuple[str, torch.Tensor]], what: str,
                            flag: torch.Tensor | None = None) -> None:
        """`check_weights` without waiting: the flags stay on the device until the next `decide` or
        `resolve` reads them (all ranks call). `flag`: a non-finite flag computed already (non-zero: a
        weight is non-finite), e.g. by the fused optimizer step as it wrote the weights."""
        limit = self.weight_limit
        if flag is not None and limit is None:
            self._pending = (flag, torch.zeros((), dtype=torch.bool, device=flag.device), named, what)
            return
        norms = local_max_abs([t for _, t in named])
        if not norms:
            no = torch.zeros((), dtype=torch.bool)
            self._pending = (no if flag is None else flag, no, named, what)
            return
        peak = torch.stack(norms).max()
        bad = ~torch.isfinite(peak) if flag is None else flag
        grown = peak > limit if limit is not None else torch.zeros((), dtype=torch.bool, device=peak.device)
        self._pending = (bad, grown, named, what)

    def resolve(self) -> None:
        """Read a pending weight check now: raise NonFiniteError / DivergenceError if it found a
        non-finite or diverged weight on any rank (all ranks call)."""
        if self._pending is None:
            return
        bad, grown = _reduce_any(torch.stack([self._pending[0].reshape(()).double().cpu(),
                                              self._pending[1].reshape(()).double().cpu()]))
        if bad or grown:
            self._raise_pending(bad)
        self._pending = None

    def _raise_pending(self, nonfinite: bool) -> None:
        assert self._pending is not None
        flag, _, named, what = self._pending
        self._pending = None
        if nonfinite:
            name = first_nonfinite(named) if bool(flag) else None
            where = f" ({name})" if name else ""
            raise NonFiniteError(f"non-finite weights{where} {what}: stopping without saving; "
                                 "lower the learning rate (or --max_norm) and resume from a checkpoint")
        peak, name = largest(named)
        peak = float(D.all_reduce_max(peak))
        where = f" ({name})" if name else ""
        raise DivergenceError(
            f"weights diverged {what}: the largest |weight| is {peak:.3g}{where}, more than --max_weight_growth "
            f"{self.max_weight_growth:g} x {max(1.0, self.start_peak or 0.0):.3g} (the largest at the start of "
            "training, at least 1): stopping without saving; lower the learning rate and resume from a "
            "checkpoint saved before this")
