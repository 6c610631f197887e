"""A ``reward_func`` file run in worker processes (``--reward_workers N``).

In the trainer's process a ``reward_func`` runs in threads (``PythonRewardSource``), so CPU-bound
reward code (string scans, answer parsing, sympy) holds the GIL that the rollout engine's loop
needs: the GPU idles between decode chunks while rewards are computed, and what is left of the
rewards runs after the last chunk with the GPU idle (bench/rl_step.py shows how much of the
generation phase that is).

``ProcessRewardSource`` sends each (batched) call to one of N worker processes
(``reward_worker.py``, which imports the file once and serves calls until its stdin closes); up to
N calls run at once, beside the engine. Each call gets ``timeout_s``: past it the worker is killed
and replaced, and the call fails as an ``EpisodeError`` naming the file (the sample then follows
``--reward_failure``), as does an exception in ``reward_func`` (the worker goes on) or a worker that
dies. The parent imports the file too, first, so that a broken file stops the run at start with the
usual message.

The price of processes: arguments and results are pickled (strings and numbers: cheap); module
state of the file is per worker; a ``reward_func`` that loads a model on the GPU would load it N
times (keep such a file in threads: ``--reward_workers 0``, the default).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from queue import Empty, Queue
from typing import Any, Sequence

from rlhfkit.agents.reward_func import FLAG, load_reward_func, make_reward_source, parse_reward_return
from rlhfkit.agents.reward_types import RewardOutput
from rlhfkit.agents.user_code import EpisodeError
from rlhfkit.config.notes import note_once

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_worker.py")
_pools: "weakref.WeakSet[ProcessRewardSource]" = weakref.WeakSet()


class _Lost(Exception):
    """The worker ran past its time limit, or died."""


class _Worker:
    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen([sys.executable, WORKER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ready = False

    def call(self, payload: bytes | None, timeout_s: float | None) -> tuple[str, Any]:
        """Send `payload` (None: only read the start-up answer) and read the answer."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if payload is not None:
            try:
                self.proc.stdin.write(struct.pack(">Q", len(payload)) + payload)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise _Lost(self._died()) from None
        (n,) = struct.unpack(">Q", self._read(8, deadline))
        return pickle.loads(self._read(n, deadline))

    def _read(self, n: int, deadline: float | None) -> bytes:
        fd, buf = self.proc.stdout.fileno(), bytearray()
        while len(buf) < n:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                raise _Lost("timeout")
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise _Lost(self._died())
            buf += chunk
        return bytes(buf)

    def _died(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return f"the reward worker process died (exit code {code})"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for s in (self.proc.stdin, self.proc.stdout):
            try:
                s.close()
            except OSError:
                pass


class ProcessRewardSource:
    """``reward_func`` of the file `path` in up to `workers` processes, started on first use; a
    RewardSource (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, workers: int, timeout_s: float | None = 300.0) -> None:
        if workers < 1:
            raise ValueError(f"--reward_workers must be >= 1 for worker processes, got {workers}")
        load_reward_func(str(path))  # a broken file stops the run here, named
        self.path, self.name = os.path.abspath(str(path)), str(path)
        self.workers, self.timeout_s = workers, timeout_s
        self._idle: Queue[_Worker] = Queue()
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        self.num_restarts = 0  # workers replaced after a time-out or a crash
        _pools.add(self)

    async def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardOutput:
        n = len(queries)
        if len(prompts) != n or len(labels) != n:
            raise ValueError(f"queries/prompts/labels lengths differ: {n}, {len(prompts)}, {len(labels)}")
        raw = await asyncio.to_thread(self._call, pickle.dumps((list(queries), list(prompts), list(labels))))
        return parse_reward_return(raw, n, f"{self.name}: reward_func")

    def _take(self) -> _Worker:
        """An idle worker, a new one while fewer than `workers` live, else the next to be freed."""
        while True:
            with self._lock:
                try:
                    return self._idle.get_nowait()
                except Empty:
                    pass
                if len(self._live) < self.workers:
                    w = _Worker(self.path)
                    self._live.add(w)
                    return w
            try:  # polled: a worker dropped meanwhile frees a place instead of returning to the queue
                return self._idle.get(timeout=0.1)
            except Empty:
                continue

    def _call(self, payload: bytes) -> Any:
        w = self._take()
        try:
            if not w.ready:
                status, value = w.call(None, self.timeout_s)
                if status != "ok":
                    raise _Lost(value)
                w.ready = True
            status, value = w.call(payload, self.timeout_s)
        except _Lost as e:
            self._drop(w)
            why = f"reward_func took more than --reward_timeout {self.timeout_s:g} s" if str(e) == "timeout" else str(e)
            raise EpisodeError(f"{FLAG} {self.name}: {why}") from None
        self._idle.put(w)
        if status != "ok":
            raise EpisodeError(f"{FLAG} {self.name}: {value}")
        return value

    def _drop(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._live.discard(w)
            self.num_restarts += 1

    def close(self) -> None:
        """Stop every worker (their stdin closes: they exit; killed if they do not within 5 s)."""
        with self._lock:
            live, self._live = list(self._live), set()
        for w in live:
            try:
                w.proc.stdin.close()
                w.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            w.kill()


def reward_source_with_workers(remote_rm_url: Any, timeout_s: float | None = 300.0, workers: int = 0) -> Any:
    """``--remote_rm_url`` as `reward_func.make_reward_source` makes it, except that with `workers` > 0
    (``--reward_workers``) a ``.py`` file runs in a ProcessRewardSource; for a reward server or a
    Python callable the flag has no effect, and a note says so."""
    if workers < 0:
        raise ValueError(f"--reward_workers must be >= 0, got {workers}")
    if workers and isinstance(remote_rm_url, (str, os.PathLike)):
        urls = [u.strip() for u in str(remote_rm_url).split(",") if u.strip()]
        if len(urls) == 1 and urls[0].endswith(".py"):
            return ProcessRewardSource(urls[0], workers, timeout_s=timeout_s)
    if workers:
        note_once("note: --reward_workers has no effect here: it runs a reward_func .py file in worker processes; "
                  "a reward server or a Python callable is called as before")
    return make_reward_source(remote_rm_url, timeout_s)


@atexit.register
def _close_all() -> None:
    for pool in list(_pools):
        pool.close()
