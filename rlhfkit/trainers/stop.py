"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM (what SLURM and Kubernetes send first).

The CLI installs `StopSignals` around a run (rlhfkit.cli.run_dir.training_run); the loops (offline and
RL) ask it at each step:

    before the loop        a signal ends the run at once: RunStopped, nothing to save
    in a step              the step goes on; at its end the loop writes a resumable checkpoint and
                           raises RunStopped (the CLI prints one line: the checkpoint and the exact
                           resume command; exit code 130 for SIGINT, 143 for SIGTERM)
      a second signal, or  the step is abandoned (StepAbandoned) unless it has begun changing the
      --stop_grace_s       weights (`commit()`, just before the optimizer step or the RL update): the
      seconds passing      checkpoint is then of the last finished step
    while saving           signals wait until the checkpoint is written
    after the loop         the run finishes (final save); a note says the signal came late

Under torchrun every rank receives the signal; the ranks agree on the step to stop at (an
all-reduce), and a step is never abandoned there (a rank leaving a collective would hang the
others), nor under Ray (`can_abandon`).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

NAMES: dict[int, str] = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class RunStopped(BaseException):
    """The run ended on a signal; `str()` is the one line to print, `exit_code` 128 + the signal."""

    def __init__(self, signum: int, message: str, saved: str | None = None) -> None:
        super().__init__(message)
        self.signum, self.saved = signum, saved  # the checkpoint written, if any

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


class StepAbandoned(BaseException):
    """Raised in the main thread to abandon a step that did not finish in time."""


class StopSignals:
    """SIGINT / SIGTERM handlers of one run and the state the loops read (module docstring)."""

    def __init__(self, grace_s: float = 10.0, can_abandon: bool = True) -> None:
        self.grace_s, self.can_abandon = grace_s, can_abandon
        self.signum: int | None = None
        self.phase = "setup"  # setup -> training -> (saving) -> finishing
        self.committed = False  # the current step has begun changing the weights
        self._old: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    # ------------------------------------------------------------------ installing

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in NAMES:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        self._cancel_timer()
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    @property
    def name(self) -> str:
        return NAMES.get(self.signum, f"signal {self.signum}") if self.signum else ""

    # ------------------------------------------------------------------ the handler

    def _handle(self, signum: int, frame: Any) -> None:
        if self.phase == "setup":
            self.signum = signum
            raise RunStopped(signum, f"stopped by {NAMES[signum]} before training started: nothing to save")
        if self.phase in ("saving", "finishing"):
            self.signum = self.signum or signum
            return
        if self.signum is None:  # training: finish the step, then stop
            self.signum = signum
            if self.can_abandon and self.grace_s >= 0:
                # a real signal to the main thread: it also wakes a blocking call (a sleep, a wait on a lock)
                main = threading.main_thread().ident
                self._timer = threading.Timer(self.grace_s, signal.pthread_kill, args=(main, signum))
                self._timer.daemon = True
                self._timer.start()
            return
        if self.can_abandon and not self.committed:  # again (or the grace time is over): abandon the step
            self._cancel_timer()
            raise StepAbandoned()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------------ what the loops call

    def start_training(self) -> None:
        self.phase = "training"

    def end_training(self) -> None:
        """The loop is over: a signal from here on lets the run finish (its final save)."""
        self.phase = "finishing"
        self._cancel_timer()

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step: abandonable (StepAbandoned) until `commit()`."""
        self.committed = False
        try:
            yield
        finally:
            self.committed = True

    def commit(self) -> None:
        """The step begins to change the weights: it is finished, whatever signals come."""
        self.committed = True

    def requested(self, agree: Callable[[bool], bool] | None = None) -> bool:
        """Whether to stop after this step; `agree` makes every rank take the same decision."""
        want = self.signum is not None
        return agree(want) if agree is not None else want

    def stop(self, step: int, save: Callable[[], str] | None, abandoned: bool) -> RunStopped:
        """Write the checkpoint (signals wait meanwhile) and the RunStopped to raise."""
        self._cancel_timer()
        signum = self.signum or signal.SIGINT
        how = (f"during step {step + 1} (abandoned after {self.grace_s:g} s or a second signal)" if abandoned
               else f"after step {step}")
        if save is None or step == 0:
            return RunStopped(signum, f"stopped by {NAMES[signum]} {how}: no step finished, nothing to save")
        self.phase = "saving"
        try:
            where = save()
        except Exception as e:  # noqa: BLE001 - the stop line says why nothing was saved
            return RunStopped(signum, f"stopped by {NAMES[signum]} {how}: the checkpoint was not saved: {e}")
        finally:
            self.phase = "finishing"
        return RunStopped(signum, f"stopped by {NAMES[signum]} {how}: checkpoint {where}", saved=where)


_ACTIVE: StopSignals | None = None
_IDLE = StopSignals(can_abandon=False)  # when no run installed any: nothing ever requested


def current() -> StopSignals:
    """The StopSignals of the run in progress (an inert one outside `active`)."""
    return _ACTIVE if _ACTIVE is not None else _IDLE


@contextmanager
def active(grace_s: float = 10.0, can_abandon: bool = True) -> Iterator[StopSignals]:
    """Install the handlers for the duration of a run (main thread only; elsewhere inert)."""
    global _ACTIVE
    previous = _ACTIVE
    stop = StopSignals(grace_s, can_abandon).install()
    _ACTIVE = stop
    try:
        yield stop
    finally:
        stop.uninstall()
        _ACTIVE = previous
