"""The builtin engine's inbox: requests from any thread, taken by the engine's worker thread.

`put` (any thread) queues requests and wakes the worker; `wait` blocks the worker until woken;
`gather_burst` lets an idle worker wait for the rest of a burst (requests arriving one by one, as an
RL step's episodes do) until none has come for `window_s`, at most 10 x `window_s` in all; `drain`
hands everything queued to the scheduler."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable


class Inbox:
    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()

    def put(self, items: list[Any]) -> None:
        for it in items:
            self._q.put(it)
        self._wake.set()

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
