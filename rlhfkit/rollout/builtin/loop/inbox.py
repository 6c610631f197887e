"""The builtin engine's inbox: requests from any thread, taken by the engine's worker thread.

`put` (any thread) queues requests and wakes the worker; `wait` blocks the worker until woken;
`gather_burst` lets an idle worker wait for the rest of a burst (requests arriving one by one, as an
RL step's episodes do): until the `expect(n)`ed requests have all been put, at most `EXPECT_MAX_S`,
or without a hint until none has come for `window_s`, at most 10 x `window_s`; `drain` hands
everything queued to the scheduler."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable


EXPECT_MAX_S = 0.05


class Inbox:
    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._puts = 0  # requests put, ever
        self._target = 0  # `expect`: gather until this many were put

    def put(self, items: list[Any]) -> None:
        with self._lock:
            self._puts += len(items)
        for it in items:
            self._q.put(it)
        self._wake.set()

    def expect(self, n: int) -> None:
        """`n` requests are about to be put (a caller starting that many episodes at once)."""
        with self._lock:
            self._target = self._puts + max(0, int(n))

    def wake(self) -> None:
        self._wake.set()

    def wait(self, timeout: float) -> None:
        self._wake.wait(timeout=timeout)
        self._wake.clear()

    def empty(self) -> bool:
        return self._q.empty()

    def gather_burst(self, window_s: float, stop: Callable[[], bool]) -> None:
        if window_s <= 0 or self._q.empty():
            return
        if self._puts < self._target:  # a hinted burst: until all of it is in
            deadline = time.perf_counter() + EXPECT_MAX_S
            while self._puts < self._target and time.perf_counter() < deadline and not stop():
                time.sleep(window_s / 10)
            return
        deadline = time.perf_counter() + 10 * window_s
        seen = self._q.qsize()
        while time.perf_counter() < deadline and not stop():
            time.sleep(window_s)  # the GIL is free for the threads still submitting
            now = self._q.qsize()
            if now == seen:
                return
            seen = now

    def drain(self, add: Callable[[Any], None]) -> None:
        while True:
            try:
                add(self._q.get_nowait())
            except queue.Empty:
                return
