"""Failure handling for Ray actors: labelled waits, a health monitor, one clear error.

Every remote call the driver makes goes through `wait_all(refs, labels, monitor)`:

    ray.wait(pending, num_returns=1, timeout=poll)   # never an unbounded ray.get
      ready ref   -> ray.get; RayActorError ("died") / RayTaskError ("raised") -> RoleFailure
      every poll  -> monitor.check(): a death seen by the monitor thread ends the wait too

`HealthMonitor` pings every registered actor every `interval` seconds from a daemon thread
(role workers run two threads and engine workers are async, so a busy actor still answers).
A ping that comes back as `RayActorError` means the actor's process is gone: the failure is
recorded, every `wait_all` and engine call raises it, and `on_failure` runs (the CLI uses it to
end the process after a grace period even if the driver sits in user code, e.g. a slow
reward_func). A ping that is merely slow is not a failure (the actor may be busy).

`RoleFailure` names the role, the rank, the process and node, and the error, e.g.
"policy rank 1 (pid 4242, node 10.0.0.2) died: Worker unexpectedly exits ...".
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from rlhfkit.roles.memory import RoleOutOfMemory

log = logging.getLogger(__name__)


class RoleFailure(RuntimeError):
    """An actor of a role group (or an engine) died or raised; the message says which and why.
    `cause`: the exception the actor raised, when it raised one."""

    cause: BaseException | None = None


@dataclass
class ActorLabel:
    """Who an actor is, for error messages: `policy rank 0 (pid 123, node 10.0.0.1)`."""

    role: str
    rank: int
    pid: int | None = None
    node: str | None = None

    def __str__(self) -> str:
        where = []
        if self.pid is not None:
            where.append(f"pid {self.pid}")
        if self.node:
            where.append(f"node {self.node}")
        return f"{self.role} rank {self.rank}" + (f" ({', '.join(where)})" if where else "")


def _death_detail(err: RayActorError) -> str:
    """The informative part of Ray's long actor-death message."""
    msg = str(err)
    for key in ("Worker exit detail:", "The actor is dead because", "actor died because"):
        i = msg.find(key)
        if i >= 0:
            return " ".join(msg[i:].split())[:300]
    return " ".join(msg.split())[:300]


def describe(err: BaseException, label: Any) -> RoleFailure:
    """A Ray error of actor `label` -> RoleFailure with a one-line cause."""
    if isinstance(err, RoleFailure):
        return err
    if isinstance(err, RayActorError):
        return RoleFailure(f"{label} died: {_death_detail(err)}")
    if isinstance(err, RayTaskError):
        cause = err.cause if err.cause is not None else err
        if isinstance(cause, RoleFailure):
            return cause
        if isinstance(cause, RoleOutOfMemory):  # its message names the role, rank and phase already
            failure = RoleFailure(str(cause))
        else:
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            failure = RoleFailure(f"{label} raised {type(cause).__name__}: {first}")
        failure.cause = cause
        return failure
    return RoleFailure(f"{label} failed: {type(err).__name__}: {err}")


class HealthMonitor:
    """Pings registered actors from a daemon thread; see the module docstring."""

    def __init__(self, interval: float = 5.0, ping_timeout: float = 10.0,
                 on_failure: Callable[[RoleFailure], None] | None = None) -> None:
        self.interval, self.ping_timeout = interval, ping_timeout
        self.on_failure = on_failure
        self.failure: RoleFailure | None = None
        self._actors: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, actor: Any, label: Any) -> None:
        with self._lock:
            self._actors.append((actor, label))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rlhfkit-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ping_timeout + 1)
            self._thread = None

    def check(self) -> None:
        """Raise the recorded failure, if any."""
        if self.failure is not None:
            raise self.failure

    def fail(self, failure: RoleFailure) -> None:
        if self.failure is None:
            self.failure = failure
            log.error("%s", failure)
            if self.on_failure is not None:
                self.on_failure(failure)

    def ping_all(self) -> None:
        """One round of pings; records the first dead actor found."""
        with self._lock:
            actors = list(self._actors)
        if not actors or self.failure is not None:
            return
        refs = {a.ping.remote(): label for a, label in actors}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.ping_timeout)
        for ref in ready:
            try:
                ray.get(ref, timeout=1.0)
            except RayActorError as e:
                self.fail(describe(e, refs[ref]))
                return
            except (GetTimeoutError, RayError):  # busy or a transient error: not a death
                continue

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.ping_all()
            except Exception as e:  # the monitor must never take the driver down by itself
                log.warning("health check failed: %s", e)


def wait_all(refs: Sequence[Any], labels: Sequence[Any], monitor: HealthMonitor | None = None,
             poll: float = 1.0, timeout: float | None = None) -> list[Any]:
    """Results of `refs` in order; the first actor death or exception raises a `RoleFailure`.

    `timeout` (seconds, None = no limit) bounds the whole wait; the monitor's failures end it
    at the next poll.
    """
    refs = list(refs)
    pending = {ref: i for i, ref in enumerate(refs)}
    out: list[Any] = [None] * len(refs)
    start = time.monotonic()
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll)
        for ref in ready:
            i = pending.pop(ref)
            try:
                out[i] = ray.get(ref)
            except Exception as e:
                raise describe(e, labels[i]) from None
        if monitor is not None:
            monitor.check()
        if timeout is not None and pending and time.monotonic() - start > timeout:
            late = ", ".join(str(labels[i]) for i in pending.values())
            raise RoleFailure(f"no answer within {timeout:.0f} s from {late}")
    return out
