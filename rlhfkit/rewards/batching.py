"""`BatchingRewardSource`: concurrent per-sample reward calls merged into batch calls, and a failed batch
retried caller by caller, so that only the failing samples fail (sources.py's docstring: failures)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

from rlhfkit.rewards.output import RewardOutput
from rlhfkit.rewards.returns import RewardReturnError, check_reward_output, slice_reward_output
from rlhfkit.rewards.shapes import RewardSample

logger = logging.getLogger(__name__)


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
