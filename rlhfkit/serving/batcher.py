"""serve_rm's scheduler: the items of all requests go to the model in micro-batches, round robin.

    request A (10k items) --+
    request B (1 item)    --+--> pending (round robin) --> [A0 B0 C0 A1 C1 A2 C2 A3] --thread--> score_fn
    request C (3 items)   --+                                      B, C answered; A continues

Each forward takes at most `batch_size` items, one item of each pending request in turn, and the turn
order carries over from forward to forward. A request of n items therefore waits for about
n x (requests pending) / batch_size forwards, whatever was queued before it: a 1-item request sent
behind a 10k-item one is in the next forward. Concurrent 1-item requests still share forwards (the
batch grows with load). Before a forward that is not full the batcher waits up to `wait_s`, but only
for requests being read (`announce()`), so a lone client never waits.

`score_fn(items)` runs on one worker thread (off the event loop) and returns a score or a
`Rejected(reason)` per item; a rejected item fails its request with 422 and drops the request's other
items. A request whose `submit` is cancelled (its client went away, or shutdown) loses its items not yet
in a forward at once; a forward already running finishes. Counters (`forwards`, `sequences`,
`cancelled`, `dropped`) are served by /health.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from rlhfkit.serving.request import RequestError

logger = logging.getLogger("rlhfkit.serve_rm")


@dataclass(frozen=True)
class Rejected:
    """An item the model will not score; `reason` follows "query[i] " in the 422 message."""

    reason: str


class _Job:
    __slots__ = ("items", "future", "out", "next", "scored", "closed")

    def __init__(self, items: Sequence[Any], future: asyncio.Future) -> None:
        self.items, self.future = items, future
        self.out = [0.0] * len(items)
        self.next = 0  # items handed to a forward so far
        self.scored = 0
        self.closed = False  # answered, failed or cancelled


ScoreFn = Callable[[list[Any]], Sequence["float | Rejected"]]


class FairBatcher:
    """Round-robin micro-batches over pending requests; see the module docstring."""

    def __init__(self, score_fn: ScoreFn, batch_size: int, wait_s: float) -> None:
        if batch_size < 1 or wait_s < 0:
            raise ValueError(f"need batch_size >= 1 and wait_s >= 0, got {batch_size}, {wait_s}")
        self.score_fn, self.batch_size, self.wait_s = score_fn, batch_size, wait_s
        self.pending: deque[_Job] = deque()  # requests with items not yet in a forward, in turn order
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve_rm-model")
        self.incoming = 0  # requests being read / parsed, about to be submitted
        self.forwards = self.sequences = 0  # forwards run, items scored
        self.cancelled = self.dropped = 0  # requests cancelled, items dropped unscored
        self._wakeup: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._wakeup is None:  # created in the running loop
            self._wakeup = asyncio.Event()
        return self._wakeup

    @contextmanager
    def announce(self) -> Iterator[None]:
        """Mark a request as on its way to `submit` (the batcher may wait for it)."""
        self.incoming += 1
        try:
            yield
        finally:
            self.incoming -= 1
            self._event().set()  # a batcher waiting for this request re-checks

    async def submit(self, items: Sequence[Any]) -> list[float]:
        """Scores of `items`, in order; RequestError(422) if one is rejected, (500) if the model fails."""
        if not items:
            return []
        job = _Job(items, asyncio.get_running_loop().create_future())
        del items
        self.pending.append(job)
        self._event().set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if not job.closed:
                self.cancelled += 1
                self._close(job)
            raise
        finally:  # an error raised here keeps this frame in its traceback: job -> future -> error
            del job

    def _close(self, job: _Job) -> None:
        job.closed = True
        if job.next < len(job.items):
            self.pending.remove(job)
            self.dropped += len(job.items) - job.next
            job.next = len(job.items)

    def _fail(self, job: _Job, error: RequestError) -> None:
        if not job.closed:
            self._close(job)
            if not job.future.done():
                job.future.set_exception(error)

    def _unscheduled_at_least(self, n: int) -> bool:
        total = 0
        for job in self.pending:
            total += len(job.items) - job.next
            if total >= n:
                return True
        return False

    async def _gather(self) -> None:
        """Wait for pending items; then, while the batch is not full and requests are on their way,
        wait for them up to `wait_s`."""
        event, loop = self._event(), asyncio.get_running_loop()
        while not self.pending:
            event.clear()
            await event.wait()
        deadline = loop.time() + self.wait_s
        while self.incoming and not self._unscheduled_at_least(self.batch_size):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[tuple[_Job, int]]:
        """One item of each pending request in turn, until the batch is full."""
        batch: list[tuple[_Job, int]] = []
        while self.pending and len(batch) < self.batch_size:
            job = self.pending.popleft()
            batch.append((job, job.next))
            job.next += 1
            if job.next < len(job.items):
                self.pending.append(job)
        return batch

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._gather()
            batch = self._take()
            if not batch:  # everything pending was cancelled meanwhile
                continue
            try:
                results = await loop.run_in_executor(self.executor, self.score_fn, [j.items[i] for j, i in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"score_fn returned {len(results)} results for {len(batch)} items")
            except Exception as e:  # the model failed: fail these requests, keep serving
                logger.exception("reward model forward failed")
                for job in {id(j): j for j, _ in batch}.values():
                    self._fail(job, RequestError(500, f"reward model failed: {type(e).__name__}: {e}"))
                continue
            self.forwards += 1
            self.sequences += len(batch)
            for (job, i), result in zip(batch, results):
                if job.closed:  # cancelled or failed while the forward ran
                    continue
                if isinstance(result, Rejected):
                    self._fail(job, RequestError(422, f"query[{i}] {result.reason}"))
                    continue
                job.out[i] = result
                job.scored += 1
                if job.scored == len(job.items):
                    job.closed = True
                    if not job.future.done():
                        job.future.set_result(job.out)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
