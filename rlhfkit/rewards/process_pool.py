"""A ``reward_func`` file run in worker processes: where ``--reward_timeout`` can end a call (the default).

Why processes. In a thread of the trainer nothing can stop a ``reward_func`` that does not return: a
time limit only abandons the call, which goes on spinning and slowing every later step, and a call that
holds the GIL inside one C call (a regular expression that backtracks without end) stops the trainer
itself: its event loop never runs again, not even to notice the time limit. A worker process is killed
(SIGKILL) past ``--reward_timeout`` and replaced, and the call fails as one sample's ``EpisodeError``
(the sample then follows ``--reward_failure``). CPU-bound reward code also runs beside the rollout
engine instead of taking its GIL.

    trainer's event loop                            worker process i (worker.py)
    await source(queries, prompts, labels)
      take an idle worker (or start one, up to N)
      request frame ---------- stdin ---------->    reward_func(queries, prompts, labels)
      await the answer pipe (loop.add_reader)       (prints go to the trainer's stdout / stderr)
      <------------------ answer pipe ----------    ("ok", value, "") | ("error", text, user frames)
      past --reward_timeout, or cancelled: SIGKILL the worker; the next call starts a new one

No thread waits for a worker: the answer pipe is watched by the caller's event loop, so a call cancelled
because the run stops (``--reward_failure stop`` ends the other episodes) kills its worker at once and the
run ends without waiting for it.

Workers are fresh interpreters (``subprocess`` running ``worker.py``: what multiprocessing calls
"spawn"), never forks of the trainer: a fork of a process that has initialised CUDA has a CUDA context it
cannot use, and a fork of a process with threads (the rollout engine's, aiohttp's) can inherit a lock
that one of them held and that nobody will release; "forkserver" would need its server started before
CUDA, which a library cannot promise. A fresh interpreter imports only the user's file, and dies with
the trainer (``PR_SET_PDEATHSIG``).

The pool is started once: its first worker starts when it is made, before the first step (importing the
file overlaps the first generation), the others when calls overlap, up to N, and they serve every call of
the run (a file that imports torch costs each worker about 2 s of CPU: a run whose calls never overlap
pays it once); the training and evaluation executors share one pool per file. N is ``--reward_workers`` (default: the CPU count, at most 4; under
torchrun, each rank's share of the host's CPUs). The parent imports the file too, first, so that a
broken file stops the run at start with the usual message.

``--reward_workers 0`` keeps the threads (for a ``reward_func`` that loads a model on the GPU, which N
processes would load N times); a note says once what a time limit cannot do there. A Python callable
(the API's ``reward_funcs``) runs in threads too, with the same note: it cannot be sent to a process.
The price of processes: arguments and results are pickled (strings and numbers: cheap); module state
of the file is per worker.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections import deque
from typing import Any, Sequence

from rlhfkit.config.notes import note_once
from rlhfkit.logs import UserFramesText
from rlhfkit.rewards.output import RewardOutput
from rlhfkit.rewards.returns import parse_reward_return
from rlhfkit.rewards.reward_file import FLAG, is_reward_file, load_reward_func, split_reward_file
from rlhfkit.rewards.shapes import RewardSample, call_args, reward_shape
from rlhfkit.rewards.sources import make_reward_source
from rlhfkit.usercode.run import EpisodeError

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
MAX_DEFAULT_WORKERS = 4
THREADS_NOTE = ("note: {what} runs in threads of the trainer: --reward_timeout fails a call that does not "
                "return, but cannot stop it (it keeps running, and one that holds the GIL stalls the trainer); "
                "{fix}")
_pools: "dict[tuple, ProcessRewardSource]" = {}  # (file, workers, time limit) -> its pool


def default_workers() -> int:
    """``--reward_workers`` unset: this process's share of the CPUs it may use (torchrun starts
    LOCAL_WORLD_SIZE trainers on a host, each with its own pool), at least 1, at most MAX_DEFAULT_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(MAX_DEFAULT_WORKERS, cpus // local_ranks))


class _Lost(Exception):
    """The worker died (its answer pipe closed, or its stdin broke)."""


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class _Worker:
    """One worker process: requests on its stdin, answers on a pipe of their own (non-blocking here)."""

    def __init__(self, path: str, name: str = "reward_func") -> None:
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, WORKER, str(write_fd), path, name],
                                         stdin=subprocess.PIPE, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        self.answers = read_fd
        self.buf = bytearray()
        self.ready = False  # the start-up answer (the file imported) was read

    def send(self, payload: bytes) -> None:
        try:
            self.proc.stdin.write(struct.pack(">Q", len(payload)) + payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _Lost(self._died()) from None

    async def answer(self) -> tuple[str, Any, str]:
        (n,) = struct.unpack(">Q", await self._read(8))
        return pickle.loads(await self._read(n))

    async def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            try:
                chunk = os.read(self.answers, n - len(self.buf))
            except BlockingIOError:
                await _readable(self.answers)
                continue
            if not chunk:
                raise _Lost(self._died())
            self.buf += chunk
        out, self.buf = bytes(self.buf[:n]), self.buf[n:]
        return out

    def _died(self) -> str:
        try:
            code = self.proc.wait(timeout=2)
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
        self.close_pipes()

    def close_pipes(self) -> None:
        for close in (self.proc.stdin.close, lambda: os.close(self.answers)):
            try:
                close()
            except OSError:
                pass


class ProcessRewardSource:
    """``reward_func`` of the file `path` (or ``path.py:name``'s function) in up to `workers` processes (one
    started now, the others on demand); a RewardSource (see the module docstring). The trainer builds each
    call's arguments for the function's shape (``shapes.py``); the worker only calls it.
    ``num_restarts`` counts workers killed past the time limit or lost."""

    def __init__(self, path: str | os.PathLike, workers: int, timeout_s: float | None = 300.0) -> None:
        if workers < 1:
            raise ValueError(f"--reward_workers must be >= 1 for worker processes, got {workers}")
        self.func = load_reward_func(str(path))  # a broken file stops the run here, named
        file, self.func_name = split_reward_file(str(path))
        self.path, self.name = os.path.abspath(file), str(path)
        self.shape = reward_shape(self.func, f"{self.name}: reward_func")
        self.workers, self.timeout_s = workers, timeout_s
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        self._idle: list[_Worker] = []
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._closed = False
        self.num_restarts = 0
        first = _Worker(self.path, self.func_name)  # importing the file overlaps the first generation; the others start on demand
        self._live.add(first)
        self._idle.append(first)
        atexit.register(self.close)

    async def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                       samples: Sequence[RewardSample] | None = None) -> RewardOutput:
        n = len(queries)
        if len(prompts) != n or len(labels) != n:
            raise ValueError(f"queries/prompts/labels lengths differ: {n}, {len(prompts)}, {len(labels)}")
        args, kwargs = call_args(self.func, self.shape, list(queries), list(prompts), list(labels), samples,
                                 f"{self.name}: reward_func")
        raw = await self._call(pickle.dumps((args, kwargs)))
        return parse_reward_return(raw, n, f"{self.name}: reward_func")

    # ------------------------------------------------------------------ one call

    async def _call(self, payload: bytes) -> Any:
        w = await self._take()
        try:
            if not w.ready:
                status, value, frames = await self._within(w.answer(), "importing the file in a reward worker")
                if status != "ok":
                    raise self._error(value, frames)
                w.ready = True
            w.send(payload)
            status, value, frames = await self._within(w.answer(), "reward_func")
        except BaseException as e:  # a time limit, a lost worker, a cancelled call: nothing is left running
            self._drop(w)
            if isinstance(e, _Lost):
                raise EpisodeError(f"{self.name}: {e} in reward_func") from None
            raise
        self._release(w)
        if status != "ok":
            raise self._error(value, frames)
        return value

    async def _within(self, answer: Any, what: str) -> tuple[str, Any, str]:
        try:
            async with asyncio.timeout(self.timeout_s) as cm:
                return await answer
        except TimeoutError:
            if not cm.expired():
                raise
            raise EpisodeError(f"{self.name}: {what} did not return within {self.timeout_s:g} s (--reward_timeout); "
                               "its worker process was killed") from None

    def _error(self, value: str, frames: str) -> EpisodeError:
        err = EpisodeError(f"{self.name}: {value}")
        if frames:
            err.__cause__ = UserFramesText(frames)
        return err

    # ------------------------------------------------------------------ the pool

    async def _take(self) -> _Worker:
        """An idle worker, a new one while fewer than `workers` live, else the next one freed."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._closed:
                    raise EpisodeError(f"{self.name}: the reward workers were shut down")
                if self._idle:
                    return self._idle.pop()
                if len(self._live) < self.workers:
                    w = _Worker(self.path, self.func_name)
                    self._live.add(w)
                    return w
                freed = loop.create_future()
                self._waiters.append((loop, freed))
            try:
                await freed
            finally:
                with self._lock:
                    if (loop, freed) in self._waiters:
                        self._waiters.remove((loop, freed))

    def _wake_one(self) -> None:
        """Called with the lock held: tell one waiting call that a worker (or a place for one) is free."""
        while self._waiters:
            loop, freed = self._waiters.popleft()
            try:
                loop.call_soon_threadsafe(lambda f=freed: f.done() or f.set_result(None))
                return
            except RuntimeError:  # that call's loop is closed
                continue

    def _release(self, w: _Worker) -> None:
        with self._lock:
            if self._closed:
                w.kill()
                return
            self._idle.append(w)
            self._wake_one()

    def _drop(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._live.discard(w)
            self.num_restarts += 1
            self._wake_one()

    def close(self) -> None:
        """Stop every worker: idle ones are asked to exit (their stdin closes), busy ones are killed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live, idle = list(self._live), set(self._idle)
            self._live, self._idle = set(), []
        for w in live:
            if w in idle:
                try:
                    w.proc.stdin.close()
                except OSError:
                    pass
        for w in live:
            if w in idle:
                try:
                    w.proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            w.kill()


def close_pools() -> None:
    """Stop the worker processes of every pool (a run's end: a process that runs several trainings, the
    Python API or the tests, would otherwise keep each run's workers until it exits)."""
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


def reward_source_with_workers(remote_rm_url: Any, timeout_s: float | None = 300.0, workers: int | None = None) -> Any:
    """The reward source of ``--remote_rm_url``: a ``.py`` file runs in a ProcessRewardSource of `workers`
    (``--reward_workers``; None: `default_workers()`) processes, shared by the callers of one file and
    settings, or in threads with `workers` 0 (a note says once what that costs); a Python callable runs
    in threads (noted too); reward server URLs get the HTTP client (`workers` given: noted as unused)."""
    if workers is not None and workers < 0:
        raise ValueError(f"--reward_workers must be >= 0, got {workers}")
    urls = ([u.strip() for u in str(remote_rm_url).split(",") if u.strip()]
            if isinstance(remote_rm_url, (str, os.PathLike)) else [])
    if len(urls) == 1 and is_reward_file(urls[0]):
        if workers == 0:
            note_once(THREADS_NOTE.format(what=f"{FLAG} {urls[0]} (--reward_workers 0)",
                                          fix="leave --reward_workers unset to run it in worker processes"))
            return make_reward_source(remote_rm_url, timeout_s)
        n = default_workers() if workers is None else workers
        key = (os.path.abspath(urls[0]), n, timeout_s)
        pool = _pools.get(key)
        if pool is None or pool._closed:
            pool = _pools[key] = ProcessRewardSource(urls[0], n, timeout_s=timeout_s)
        return pool
    if workers:
        note_once("note: --reward_workers has no effect here: it runs a reward_func .py file in worker processes; "
                  "a reward server or a Python callable is called as before")
    if callable(remote_rm_url):
        note_once(THREADS_NOTE.format(what="a reward function given as a Python callable",
                                      fix="give the path of a reward_func .py file to run it in worker processes"))
    return make_reward_source(remote_rm_url, timeout_s)
