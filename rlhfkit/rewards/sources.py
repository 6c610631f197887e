"""Reward sources: the ``RewardSource`` protocol, the Python ``reward_func`` file, batching, and
the ``--remote_rm_url`` factory.

    --remote_rm_url /path/reward_func.py         -> worker processes (``process_pool.py``, the default), or
                                                    PythonRewardSource (here: threads; --reward_workers 0)
    --remote_rm_url http://host:5000/get_reward  -> the HTTP client of ``http_client.py``
    reward model                                 -> the RL loop's own RewardSource

A ``reward_func`` file (OpenRLHF format) defines

    def reward_func(queries, prompts, labels):      # or `async def`
        # queries: prompt + response text (special tokens kept); prompts; labels (--label_key)
        return {"rewards": B values, "scores": B values (optional, default rewards),
                "extra_logs": {name: one value or B values} (optional)}

or returns the B rewards alone (tensor / list). The function may instead be in TRL's shape,
``reward_func(prompts, completions, **kwargs)`` (``shapes.py``: completions without special
tokens, the row's other columns as keyword lists), and another function of the file may be named:
``--remote_rm_url reward.py:accuracy``. Values may be torch tensors. In PythonRewardSource
each call, sync or async, runs in a daemon thread with its own event loop (``usercode/run.py``) under
``timeout_s``, so an ``async def`` that blocks (``time.sleep``) fails in time too; but a thread that
runs past its time limit cannot be stopped: it is abandoned (the sample fails), and one that holds the
GIL stalls the trainer. That is why a file runs in worker processes unless ``--reward_workers 0``.

Failures (exception, ``SystemExit``, time limit, bad return value) raise ``EpisodeError`` naming
the file; the executor applies ``--reward_failure``. The return value is checked on every call: one
finite reward per sample (a single number for the batch is refused, whatever the batch size).
``BatchingRewardSource`` merges concurrent per-sample calls into one batch call; when that call
fails for one sample's sake (an exception, a sample's NaN, a request the server rejects) it is
retried one caller (one sample, for the executors) at a time, so only the failing samples fail,
and the error a caller gets is its own sample's. A failure of the whole call is not retried sample
by sample: an answer of the wrong shape (``RewardReturnError``) or a reward server that is down
after its own batch retries (``http_client.RewardServerDown``) fails every caller of the batch at
once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from rlhfkit.rewards.output import RewardOutput, RewardShapeError
from rlhfkit.rewards.shapes import SHAPES, RewardSample, call_args, reward_shape
from rlhfkit.usercode.files import import_user_file
from rlhfkit.usercode.run import EpisodeError, run_user_code

logger = logging.getLogger(__name__)

FLAG = "--remote_rm_url"


@runtime_checkable
class RewardSource(Protocol):
    """Scores a batch; ``len(out.rewards) == len(out.scores) == len(queries)``. ``samples`` (one per
    query, or None) carry what a reward function in TRL's shape reads (``shapes.RewardSample``)."""

    async def __call__(self, queries: list[str], prompts: list[str], labels: list[Any],
                       samples: Sequence[RewardSample] | None = None) -> RewardOutput:
        ...


# ----------------------------------------------------------------------------- checking values

_KNOWN_KEYS = {"rewards", "scores", "extra_logs"}


class RewardReturnError(EpisodeError):
    """A reward answer of the wrong shape for the whole batch (one number, a wrong length, no 'rewards')."""


def _check(obj: Any, n: int, source: str) -> RewardOutput:
    try:
        return RewardOutput.from_mapping(obj, n, source)
    except RewardShapeError as e:
        raise RewardReturnError(str(e)) from None
    except ValueError as e:
        raise EpisodeError(str(e)) from e


def parse_reward_return(raw: Any, n: int, source: str) -> RewardOutput:
    """Check what ``reward_func`` returned for a batch of ``n`` and build a RewardOutput."""
    if isinstance(raw, RewardOutput):
        return check_reward_output(raw, n, source)
    if not isinstance(raw, dict):
        if raw is None or isinstance(raw, (str, bytes)):
            raise RewardReturnError(f"{source}: reward_func must return a dict with 'rewards' or the rewards "
                                    f"themselves (tensor / list), got {type(raw).__name__}")
        raw = {"rewards": raw}
    unknown = set(raw) - _KNOWN_KEYS
    if unknown:  # OpenRLHF ignores other keys; say so, since a typo ('score') loses data
        logger.warning("%s: reward_func's dict has keys that are ignored: %s (known: rewards, scores, "
                       "extra_logs)", source, sorted(map(str, unknown)))
    return _check(raw, n, source)


def check_reward_output(out: Any, n: int, source: str) -> RewardOutput:
    """Validate any source's answer for a batch of ``n`` (lengths, finite numbers, extra_logs)."""
    if not isinstance(out, RewardOutput):
        raise RewardReturnError(f"{source}: reward source returned {type(out).__name__}, expected RewardOutput")
    return _check(out.to_dict(), n, source)


def split_reward_output(out: Any, n: int, source: str) -> list[tuple[float, float, dict[str, float]]]:
    """Per-sample (reward, score, extra_logs) from a batch RewardOutput."""
    out = check_reward_output(out, n, source)
    return [(out.rewards[i], out.scores[i], out.sample_logs(i)) for i in range(n)]


def slice_reward_output(out: RewardOutput, start: int, end: int) -> RewardOutput:
    """Samples ``start:end``; shared (single-number) extra_logs stay shared."""
    logs = {k: (v[start:end] if isinstance(v, list) else v) for k, v in out.extra_logs.items()}
    return RewardOutput(rewards=out.rewards[start:end], scores=out.scores[start:end], extra_logs=logs)


# ----------------------------------------------------------------------------- the Python file


_FUNC_SPEC = re.compile(r"^(.*\.py):([A-Za-z_][A-Za-z0-9_]*)$")


def is_reward_file(spec: str) -> bool:
    """A reward_func .py file, alone or with a function name (``reward.py:accuracy``)."""
    return spec.endswith(".py") or _FUNC_SPEC.match(spec) is not None


def split_reward_file(spec: str) -> tuple[str, str]:
    """``reward.py`` -> (reward.py, "reward_func"); ``reward.py:accuracy`` -> (reward.py, "accuracy")."""
    m = _FUNC_SPEC.match(spec)
    return (m.group(1), m.group(2)) if m else (spec, "reward_func")


_loaded: dict[tuple[str, str, int], Callable[..., Any]] = {}  # (path, name, mtime): the file imported once


def load_reward_func(spec: str) -> Callable[..., Any]:
    """Import the file of ``spec`` (``path.py`` or ``path.py:name``) and return its ``reward_func`` (or
    `name`), checked to be in one of the two shapes of ``shapes.py``. A file is imported once per run
    (the check when the trainer is built and the reward source read the same module)."""
    path, name = split_reward_file(spec)
    key = (os.path.abspath(path), name, os.stat(path).st_mtime_ns) if os.path.isfile(path) else None
    if key in _loaded:
        return _loaded[key]
    module = import_user_file(path, FLAG)
    fn = getattr(module, name, None)
    if not callable(fn):
        other = "" if name != "reward_func" else f" (or name another function: {FLAG} {path}:NAME)"
        raise AttributeError(f"{FLAG} {path} must define {name}: {SHAPES}{other}")
    try:
        reward_shape(fn, f"{FLAG} {spec}")
    except TypeError as e:
        raise TypeError(str(e)) from None
    _loaded[key] = fn
    return fn


class PythonRewardSource:
    """A reward function (from a file path or a callable, in either shape of ``shapes.py``) as a
    RewardSource."""

    def __init__(self, func_or_path: str | os.PathLike | Callable[..., Any], timeout_s: float | None = 300.0,
                 name: str | None = None) -> None:
        if isinstance(func_or_path, (str, os.PathLike)):
            self.name = str(func_or_path)
            self.func = load_reward_func(self.name)
            self.label = f"{self.name}: reward_func"  # names the function in every error
        else:
            self.func = func_or_path
            self.name = self.label = name or getattr(func_or_path, "__qualname__", "reward_func")
        self.shape = reward_shape(self.func, self.label)
        self.timeout_s = timeout_s

    async def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                       samples: Sequence[RewardSample] | None = None) -> RewardOutput:
        n = len(queries)
        if len(prompts) != n or len(labels) != n:
            raise ValueError(f"queries/prompts/labels lengths differ: {n}, {len(prompts)}, {len(labels)}")
        args, kwargs = call_args(self.func, self.shape, list(queries), list(prompts), list(labels), samples,
                                 self.label)
        fn = functools.partial(self.func, **kwargs) if kwargs else self.func
        raw = await run_user_code(fn, *args, what=f"{self.name}: reward_func", timeout_s=self.timeout_s)
        return parse_reward_return(raw, n, self.label)


# ----------------------------------------------------------------------------- batching


class BatchingRewardSource:
    """Merge concurrent calls into batch calls of at most ``max_batch_size`` samples.

    A call waits ``max_wait_s`` (0: one turn of the event loop) for others to join its batch.
    If a batch call of several callers fails, each caller's samples are scored again on their own
    (concurrently): callers whose retry succeeds get its result, the others its error.
    ``num_retried_batches`` counts such batches. With ``retry_within_s`` (the executors pass
    ``--reward_timeout``) the retries of one batch end within that many seconds in all: a retry still
    waiting for a worker process, or still running, then fails with the batch's error, so a batch whose
    every sample hangs costs two time limits, not one per sample.
    """

    def __init__(self, source: Any, max_batch_size: int = 64, max_wait_s: float = 0.0,
                 retry_within_s: float | None = None) -> None:
        self.source, self.max_batch_size, self.max_wait_s = source, max_batch_size, max_wait_s
        self.retry_within_s = retry_within_s
        self.name = getattr(source, "name", type(source).__name__)
        self._pending: list[tuple[list, list, list, list | None, asyncio.Future]] = []
        self._timer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.num_retried_batches = 0

    async def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                       samples: Sequence[RewardSample] | None = None) -> RewardOutput:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((list(queries), list(prompts), list(labels),
                              None if samples is None else list(samples), fut))
        if sum(len(p[0]) for p in self._pending) >= self.max_batch_size:
            self._flush()
        elif self._timer is None or self._timer.done():
            self._timer = self._spawn(self._flush_later())
        return await fut

    async def _score(self, queries: list, prompts: list, labels: list, samples: list | None) -> Any:
        if samples is None:  # a caller without samples: the source as a reward_func file's protocol
            return await self.source(queries, prompts, labels)
        return await self.source(queries, prompts, labels, samples=samples)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.max_wait_s)
        self._flush()

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            self._spawn(self._run(batch))

    async def _run(self, batch: list[tuple[list, list, list, list | None, asyncio.Future]]) -> None:
        q = [x for b in batch for x in b[0]]
        p = [x for b in batch for x in b[1]]
        lab = [x for b in batch for x in b[2]]
        smp = None if any(b[3] is None for b in batch) else [x for b in batch for x in b[3]]
        try:
            out = check_reward_output(await self._score(q, p, lab, smp), len(q), self.name)
        except Exception as e:
            if len(batch) == 1 or _whole_call_failure(e):  # one error for every caller, no retries one by one
                for item in batch:
                    _settle(item[4], error=e)
                return
            self.num_retried_batches += 1
            logger.debug("%s: a batched reward call of %d samples failed (%s: %s); scoring them one at a time",
                        self.name, len(q), type(e).__name__, e)
            await self._retry_alone(batch, e)
            return
        start = 0
        for queries, _, _, _, fut in batch:
            _settle(fut, result=slice_reward_output(out, start, start + len(queries)))
            start += len(queries)

    async def _retry_alone(self, batch: list[tuple[list, list, list, list | None, asyncio.Future]],
                           error: Exception) -> None:
        """Each caller's samples scored on their own, concurrently, within `retry_within_s` in all; the
        retries still unfinished then are cancelled (a worker process running one is killed) and their
        callers get the batch's `error`."""
        tasks = [asyncio.ensure_future(self._run_alone(*item)) for item in batch]
        try:
            await asyncio.wait(tasks, timeout=self.retry_within_s)
        finally:
            late = [t for t in tasks if not t.done()]
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late)
            for item in batch:
                _settle(item[4], error=error)  # only those whose retry did not settle them

    async def _run_alone(self, queries: list, prompts: list, labels: list, samples: list | None,
                         fut: asyncio.Future) -> None:
        if fut.done():  # the caller gave up (cancelled)
            return
        try:
            out = await self._score(queries, prompts, labels, samples)
            _settle(fut, result=check_reward_output(out, len(queries), self.name))
        except Exception as e:
            _settle(fut, error=e)


def _whole_call_failure(e: BaseException) -> bool:
    """An answer of the wrong shape, or a reward server down after its batch retries: scoring the samples
    one at a time would fail the same way, once per sample."""
    from rlhfkit.rewards.http_client import RewardServerDown

    return isinstance(e, (RewardReturnError, RewardServerDown))


def _settle(fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


# ----------------------------------------------------------------------------- factory


def make_reward_source(remote_rm_url: str | Sequence[str] | Callable[..., Any], timeout_s: float | None = 300.0
                       ) -> Any:
    """``--remote_rm_url`` in threads: one ``.py`` file -> PythonRewardSource; URL(s) (comma-separated) ->
    HTTP; a callable ``reward_func`` (the Python API's ``reward_funcs``) -> PythonRewardSource, as a file's.
    (The commands and the executors call process_pool.reward_source_with_workers, which runs a file in
    worker processes unless ``--reward_workers 0``.)"""
    if callable(remote_rm_url):
        return PythonRewardSource(remote_rm_url, timeout_s=timeout_s)
    urls = [u.strip() for u in remote_rm_url.split(",")] if isinstance(remote_rm_url, str) else list(remote_rm_url)
    urls = [u for u in urls if u]
    if not urls:
        raise ValueError(f"{FLAG} is empty")
    if any(is_reward_file(u) for u in urls):
        if len(urls) > 1:
            raise ValueError(f"{FLAG}: give one reward_func .py file or HTTP URLs, not both: {urls}")
        return PythonRewardSource(urls[0], timeout_s=timeout_s)
    return HTTPRewardSource(urls, timeout_s=timeout_s)


class HTTPRewardSource:
    """The HTTP client of ``http_client.py`` as a RewardSource (round robin, retries)."""

    def __init__(self, urls: Sequence[str], timeout_s: float | None = 180.0, **client_kw: Any) -> None:
        from rlhfkit.rewards.http_client import RemoteRewardClient

        self.client = RemoteRewardClient(list(urls), timeout_s=timeout_s or 180.0, **client_kw)
        self.name = "reward server " + ",".join(urls)

    async def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                       samples: Sequence[RewardSample] | None = None) -> RewardOutput:
        return await self.client.get_rewards(queries, prompts, labels)  # the server's protocol: no samples
