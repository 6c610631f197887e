"""`RayGroup`: a role group of N Ray actors behind the `RoleGroup` contract of rlhfkit/roles/handles.py
(the typed handles call it; `roles.group.LocalGroup` is the one-process side).

    group.on_batch(ActorRole.forward_logprobs, batch, T)
                                     batch split by rows into one contiguous shard (whole prompt
                                     groups of `unit` rows) per data-parallel rank; the tp / cp ranks
                                     of one dp rank get the same shard; the dp ranks' [b_i, L] / [b_i]
                                     tensors are concatenated, their metric dicts averaged (roles
                                     already reduce them over their process group, so every rank
                                     holds the global value)
    group.on_every_rank(method, *args)  every rank runs the role's method; rank 0's result
    group.run_all(RoleWorker.offload)   a method of the actors themselves on every rank, rank order
    group.push_weights(dtype, bucket_bytes)  every rank's weight-sync push (weightsync.RayWeightSync)

The driver's loop sees the whole batch (world size 1 from its point of view); data parallelism
happens inside the group, whose ranks share one torch process group.

`Phases` implements sleep/wake between the rollout and training phases (`--vllm_enable_sleep`:
engines sleep while any role group works and wake for generation or a weight update;
`--deepspeed_enable_sleep`: a group's training states are on the device only during its calls).
Its metrics per step: `time/engine_sleep`, `time/engine_wake`, `time/states_offload` and
`time/states_reload` (driver side, Ray calls included) and, as the ranks measured them,
`time/offload` / `time/reload` (per group the slowest rank, summed over groups) and `offload_gb`
(per group the largest rank's bytes, summed: what one GPU moved off). `time/rollout_transitions`: what
the rollout waited for before generating (training states leaving the device, the engines waking);
the loop's `time/generate` includes it, `time/generate_engines` (AsyncRLTrainer) does not.
`GroupBackend` lets the loop's checkpointer (which expects a backend) save, load and export
through the group: every rank takes part, rank 0's answer is returned.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Concatenate, Iterator, ParamSpec, Protocol, TypeVar

import torch

from rlhfkit.backend.base import TrainBackend
from rlhfkit.distributed.health import ActorLabel, HealthMonitor, wait_all
from rlhfkit.distributed.workers import RoleWorker
from rlhfkit.types import ExperienceBatch
from rlhfkit.weightsync.protocol import PushStats

P = ParamSpec("P")
R = TypeVar("R")


def split_rows(num_rows: int, num_shards: int, unit: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges, as even as possible in whole units of `unit` rows
    (single rows when `num_rows` is not a multiple of `unit`)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    unit = unit if unit > 0 and num_rows % unit == 0 else 1
    base, extra = divmod(num_rows // unit, num_shards)
    out, start = [], 0
    for i in range(num_shards):
        end = start + (base + (1 if i < extra else 0)) * unit
        out.append((start, end))
        start = end
    return out


def merge_results(results: list[Any]) -> Any:
    """Per-rank results of a split call -> one: tensors concatenated by rows, dicts averaged."""
    first = results[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(results, dim=0)
    if isinstance(first, dict):
        keys = {k for r in results for k in r}
        return {k: sum(float(r[k]) for r in results if k in r) / sum(1 for r in results if k in r)
                for k in sorted(keys)}
    if first is None:
        return None
    raise TypeError(f"cannot merge per-rank results of type {type(first).__name__}")


class SleepingEngines(Protocol):
    """The engines whose memory the phases free and restore (distributed.engines.RayEngineRouter)."""

    asleep: bool

    def sleep(self, level: int | None = None) -> None: ...

    def wake_up(self) -> None: ...


class Phases:
    """Sleep / wake between phases; see the module docstring. `engine` is set by the router.

    Under `--deepspeed_enable_sleep` a group's states leave the device lazily: `after_group` marks
    the group pending and the offload happens when another group needs the device, before the
    engines wake for a rollout, or at `flush()`. So the policy's weight push that follows its
    training step finds the states still on the device (no reload, no second offload).

    `rollout_flush=False` (async training that overlaps generation with training): a rollout
    leaves the training states alone, since it runs on another thread while the roles may be
    working; they are offloaded when the next group needs the device."""

    def __init__(self, engine_sleep: bool = False, train_sleep: bool = False, rollout_flush: bool = True) -> None:
        self.engine_sleep, self.train_sleep, self.rollout_flush = engine_sleep, train_sleep, rollout_flush
        self.engine: SleepingEngines | None = None  # the engines' router registers itself
        self.timings: dict[str, float] = {}
        self.moved: dict[str, float] = {}  # offload / reload seconds and bytes as the ranks measured them
        self._pending: RayGroup | None = None  # on the device, to be offloaded before anyone else works

    def _time(self, key: str, t0: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0

    def flush(self, keep: "RayGroup | None" = None) -> None:
        """Offload the pending group's states (unless it is `keep`)."""
        g = self._pending
        if g is None or g is keep:
            return
        self._pending = None
        t0 = time.perf_counter()
        self._record("offload", g.run_all(RoleWorker.offload))
        self._time("states_offload", t0)

    def _record(self, kind: str, stats: list[Any]) -> None:
        """Add the slowest rank's seconds (and, for an offload, the largest rank's bytes)."""
        got = [s for s in stats if isinstance(s, dict)]
        if not got:
            return
        self.moved[f"time/{kind}"] = self.moved.get(f"time/{kind}", 0.0) + max(s["seconds"] for s in got)
        if kind == "offload":
            self.moved["offload_gb"] = self.moved.get("offload_gb", 0.0) + max(s["bytes"] for s in got) / 2**30

    def before_group(self, group: "RayGroup") -> None:
        t0 = time.perf_counter()
        if self.engine_sleep and self.engine is not None and not self.engine.asleep:
            self.engine.sleep()
            self._time("engine_sleep", t0)
        self._reload(group)

    def _reload(self, group: "RayGroup") -> None:
        if not self.train_sleep:
            return
        self.flush(keep=group)
        if self._pending is group:  # still on the device from its last call
            self._pending = None
            return
        t1 = time.perf_counter()
        self._record("reload", group.run_all(RoleWorker.reload))
        self._time("states_reload", t1)

    @contextmanager
    def states_on_device(self, group: "RayGroup") -> Iterator[None]:
        """The group's training states on the device (not touching the engines' sleep)."""
        self._reload(group)
        try:
            yield
        finally:
            self.after_group(group)

    def after_group(self, group: "RayGroup") -> None:
        if self.train_sleep:
            self._pending = group

    def before_rollout(self) -> None:
        t_all = time.perf_counter()
        if self.rollout_flush:
            self.flush()
        if self.engine_sleep and self.engine is not None and self.engine.asleep:
            t0 = time.perf_counter()
            self.engine.wake_up()
            self._time("engine_wake", t0)
        self._time("rollout_transitions", t_all)  # inside the loop's time/generate: the states' offload and the wake

    def take_metrics(self) -> dict[str, float]:
        """This step's metrics (see the module docstring), reset."""
        out = {f"time/{k}": v for k, v in self.timings.items()}
        out.update(self.moved)
        self.timings, self.moved = {}, {}
        return out


class RayGroup:
    """N actors of one role; see the module docstring."""

    def __init__(self, name: str, actors: list[Any], labels: list[ActorLabel], monitor: HealthMonitor | None = None,
                 unit: int = 1, phases: Phases | None = None, weights_dtype: str | None = None,
                 dp_ranks: list[int] | None = None) -> None:
        """`dp_ranks[i]`: the data-parallel rank of actor i (default: i, pure data parallelism)."""
        if not actors:
            raise ValueError(f"role group {name} has no actors")
        self.dp_ranks = list(range(len(actors))) if dp_ranks is None else list(dp_ranks)
        if len(self.dp_ranks) != len(actors) or set(self.dp_ranks) != set(range(max(self.dp_ranks) + 1)):
            raise ValueError(f"role group {name}: dp ranks {self.dp_ranks} must number its {len(actors)} actors "
                             f"0..dp-1")
        self.name, self.actors, self.labels = name, actors, labels
        self.monitor, self.unit, self.phases = monitor, unit, phases
        self.weights_dtype = weights_dtype

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def dp_size(self) -> int:
        return max(self.dp_ranks) + 1

    def run_all(self, method: Callable[Concatenate[RoleWorker, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """A `RoleWorker` method on every rank with the same arguments; results in rank order."""
        refs = [getattr(a, method.__name__).remote(*args, **kwargs) for a in self.actors]
        return wait_all(refs, self.labels, self.monitor)

    def push_weights(self, dtype: str | None, bucket_bytes: int) -> list[PushStats]:
        """`RoleWorker.push_weights` on every rank (each gathers; the senders send); rank order."""
        return wait_all([a.push_weights.remote(dtype, bucket_bytes) for a in self.actors], self.labels, self.monitor)

    def states_on_device(self) -> AbstractContextManager[None]:
        """The group's training states on the device for a call outside `call` (--deepspeed_enable_sleep)."""
        return self.phases.states_on_device(self) if self.phases is not None else nullcontext()

    @contextmanager
    def _working(self) -> Iterator[None]:
        """The phase hooks around a call: engines asleep and this group's states back, if they sleep."""
        if self.phases is not None:
            self.phases.before_group(self)
        try:
            yield
        finally:
            if self.phases is not None:
                self.phases.after_group(self)

    def on_batch(self, method: Callable[Concatenate[Any, ExperienceBatch, P], R], batch: ExperienceBatch,
                 *args: P.args, **kwargs: P.kwargs) -> R:
        with self._working():
            ranges = split_rows(batch.batch_size, self.dp_size, self.unit)
            refs = [a.call.remote(method.__name__, batch.select(list(range(*ranges[d]))), *args, **kwargs)
                    for a, d in zip(self.actors, self.dp_ranks)]
            first: dict[int, Any] = {}  # the replicas of one dp rank return the same result
            for d, res in zip(self.dp_ranks, wait_all(refs, self.labels, self.monitor)):
                first.setdefault(d, res)
            return merge_results([first[d] for d in range(self.dp_size)])

    def on_every_rank(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        with self._working():
            return self.run_all(RoleWorker.call, method.__name__, *args, **kwargs)[0]

    def __repr__(self) -> str:
        return f"RayGroup({self.name}, {self.world_size} ranks)"


class GroupBackend:
    """Backend-shaped proxy over a RayGroup, for `RLCheckpointer` (save / load / export)."""

    def __init__(self, group: RayGroup) -> None:
        self.group = group

    def _all(self, method: Callable[Concatenate[TrainBackend, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        with self.group._working():
            return self.group.run_all(RoleWorker.backend_call, method.__name__, *args, **kwargs)[0]

    def save_checkpoint(self, ckpt_root: str, tag: str, client_state: dict | None, max_keep: int) -> str:
        return self._all(TrainBackend.save_checkpoint, ckpt_root, tag, client_state, max_keep)

    def load_checkpoint(self, ckpt_root: str, tag: str | None = None) -> dict | None:
        return self._all(TrainBackend.load_checkpoint, ckpt_root, tag)

    def save_hf(self, path: str, tokenizer: Any = None, dtype: torch.dtype | None = None) -> None:
        self._all(TrainBackend.save_hf, path, tokenizer, dtype)
