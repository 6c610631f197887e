"""`AsyncRLTrainer`: the RL loop (`RLTrainer`) over an engine router that versions the policy, with
engine / sleep metrics and, for `--async_train`, a background producer.

    sync:     rollout under the router's weight lock -> train -> weight sync (version + 1)
    async:    producer thread (a shallow copy of this trainer with its own data cursor) runs the
              parent's rollout() at most `async_queue_size` batches ahead (async_queue.py)
              trainer:  item = queue.get() -> its cursor becomes this trainer's (checkpoints) -> train

The router is any engine with `hold_weights()`, `version`, `set_version()`, `take_metrics()` and a
`partial_rollout` switch (`distributed.engines.RayEngineRouter`); `phases` gives the sleep / wake
metrics (`distributed.group.Phases`); `monitor.check()` raises when an actor died. Nothing here
imports Ray.

`partial_rollout`: the producer generates without holding the router's weight lock, so a weight
update pauses the engines mid-batch and the generations in flight continue with the new weights;
each token keeps its own version (`staleness_token_*`, `mixed_version_samples`). `take_turns`
(async with engines that sleep while the roles work, on shared GPUs): the trainer and the producer
hold one lock by turns, the producer for a whole batch and the trainer for everything but its wait
for a batch, so the engines never sleep under a generation.
"""

from __future__ import annotations

import copy
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

from rlhfkit.trainers.async_queue import AsyncRolloutQueue, staleness_metrics, stamp_versions
from rlhfkit.trainers.rl import RLState, RLTrainer
from rlhfkit.trainers.rl_contracts import Liveness, PhaseMetrics, VersionedEngines


@dataclass
class _Batch:
    trajs: list
    metrics: dict
    cursor: tuple[int, int, int]
    version: int
    seconds: float


class _Closed(Exception):
    """The run is ending: the async producer stops before its next batch."""


class AsyncRLTrainer(RLTrainer):
    """See the module docstring. The producer's batches keep the prompt order and sampling seeds of
    a synchronous run; consuming a batch moves this trainer's data cursor to it."""

    def __init__(self, *args: Any, router: VersionedEngines, phases: PhaseMetrics, monitor: Liveness,
                 async_queue_size: int = 0, partial_rollout: bool = False, take_turns: bool = False,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.router, self.phases, self.monitor = router, phases, monitor
        self.async_queue_size = async_queue_size
        self.router.partial_rollout = partial_rollout
        self._turn = threading.Lock() if take_turns else None
        self._closing = False
        self._aligned = False
        self._producer: AsyncRolloutQueue | None = None

    def rollout(self):
        if not self._aligned:  # the engines hold the weights of this step (a resumed run: not 0)
            self.router.set_version(self.state.step)
            self._aligned = True
        if not self.async_queue_size:
            with self.router.hold_weights() as version:
                trajs, m = super().rollout()
            stamp_versions(trajs, version)
            return trajs, m
        if self._producer is None:
            self._producer = self._start_producer()
        with self._turn_given():
            item: _Batch = self._producer.get(check=self.monitor.check)
        self.state.cursor = item.cursor
        item.metrics.update(staleness_metrics(item.trajs, self.state.step), **{"time/generate_async": item.seconds})
        return item.trajs, item.metrics

    @contextmanager
    def _turn_given(self) -> Iterator[None]:
        """The trainer lets the producer generate while it waits for a batch (take_turns)."""
        if self._turn is None:
            yield
            return
        self._turn.release()
        try:
            yield
        finally:
            self._turn.acquire()

    @contextmanager
    def _turn_taken(self) -> Iterator[None]:
        """The producer's turn for one batch (take_turns); _Closed once the run ends."""
        if self._turn is None:
            yield
            return
        while not self._turn.acquire(timeout=0.5):
            if self._closing:
                raise _Closed()
        try:
            if self._closing:
                raise _Closed()
            yield
        finally:
            self._turn.release()

    def _start_producer(self):
        gen = copy.copy(self)
        gen.state = RLState(step=self.state.step)
        gen.state.cursor = self.state.cursor
        router = self.router

        def produce(i: int, started) -> _Batch:
            t0 = time.perf_counter()
            # partial rollout: the version when the batch starts; weight updates may land inside it
            hold = nullcontext(router.version) if router.partial_rollout else router.hold_weights()
            with self._turn_taken(), hold as version:
                started()
                trajs, m = RLTrainer.rollout(gen)
            gen.state.step += 1
            stamp_versions(trajs, version)
            return _Batch(trajs, m, gen.state.cursor, version, time.perf_counter() - t0)

        return AsyncRolloutQueue(produce, self.total_steps() - self.state.step, self.async_queue_size).start()

    def train_step(self) -> dict[str, float]:
        m = super().train_step()
        m.update(self.router.take_metrics())
        phases = self.phases.take_metrics()
        m.update(phases)
        waited = phases.get("time/rollout_transitions")
        if waited is not None and not self.async_queue_size and "time/generate" in m:
            # the rollout first waited for the training states to leave the device and the engines to
            # wake (sleep modes): generation proper is the rest
            m["time/generate_engines"] = m["time/generate"] - waited
        return m

    def fit(self) -> RLState:
        if self._turn is not None:
            self._turn.acquire()
        try:
            return super().fit()
        finally:
            self._closing = True
            if self._turn is not None:
                self._turn.release()
            if self._producer is not None:
                self._producer.close()
                self._producer = None
