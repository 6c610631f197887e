"""The typed seams of a weight sync: what a transport, a policy rank's sender, an engine's
receiver and the driver-side handles must offer, and the record a push returns.

    driver        WeightTransport.connect(peers)      once: a sender per policy rank, a receiver
                                                      per engine shard (`SyncPeers.install`)
    policy rank   WeightSender.open(device)           (actor) form groups, check them
                  WeightSender.push(named, cast, bucket_bytes) -> PushStats   once per step
    engine shard  BucketReceiver.open(device) / receive(metas, payload) / done()
    driver        WeightTransport.collect(pushed, engines) -> tensors loaded per engine shard
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Protocol, Sequence

import torch

from rlhfkit.weightsync.buckets import Named, TensorMeta

if TYPE_CHECKING:
    from ray.actor import ActorHandle
else:
    ActorHandle = Any  # a Ray actor (RoleWorker / EngineWorker); only the Ray paths hold one

Wait = Callable[[list[Any], list[tuple[str, int]]], list[Any]]  # (refs, ("policy" | "engine", index)) -> results


@dataclass
class PushStats:
    """One policy rank's part of a sync: `bytes` and `buckets` it sent (0 on ranks that only
    gather), tensors each of its engine shards loaded, and the object-store refs (rank 0)."""

    method: str
    bytes: int = 0
    buckets: int = 0
    engine_tensors: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    refs: list[Any] = field(default_factory=list)


class WeightSender(Protocol):
    """Policy-rank side, built on the driver and opened in the actor."""

    def open(self, device: str) -> None: ...

    def push(self, named: Iterable[Named], cast: torch.dtype | None, bucket_bytes: int) -> PushStats: ...


class BucketReceiver(Protocol):
    """Engine-shard side of a direct transport: `receive` gives views to load, then `done()`."""

    def open(self, device: str) -> None: ...

    def receive(self, metas: Sequence[TensorMeta], payload: Any) -> list[Named]: ...

    def done(self) -> None: ...


class EngineShards(Protocol):
    """The driver's view of the engines (RayEngineRouter)."""

    shards: list[ActorHandle]

    def before_update(self) -> None: ...

    def updating(self) -> AbstractContextManager[None]: ...

    def load_from_object_store(self, refs: list[Any]) -> list[int]: ...


@dataclass
class SyncPeers:
    """The actors a transport connects: every policy rank and every engine shard, with their IPs."""

    policy: Sequence[ActorHandle]
    policy_ips: Sequence[str]
    engines: Sequence[ActorHandle]
    engine_ips: Sequence[str]
    wait: Wait
    timeout_s: float

    def install(self, senders: Sequence[WeightSender], receivers: Sequence[BucketReceiver] = ()) -> None:
        """Every policy rank opens its sender and every engine shard its receiver (none: the engines
        take no part in the setup), all at once: the members of a broadcast group join together."""
        refs: list[Any] = []
        who: list[tuple[str, int]] = []
        for r, (actor, s) in enumerate(zip(self.policy, senders, strict=True)):
            refs.append(actor.init_weight_sync.remote(s))
            who.append(("policy", r))
        for i, (engine, rcv) in enumerate(zip(self.engines if receivers else (), receivers, strict=True)):
            refs.append(engine.init_weight_sync.remote(rcv))
            who.append(("engine", i))
        self.wait(refs, who)


class WeightTransport(Protocol):
    """One way of moving the policy's weights into the engines, chosen once (`choice.choose_transport`)."""

    name: ClassVar[str]  # the metric's and the log's name: weight_sync/<name>

    def describe(self) -> str:
        """The `weight sync:` log line's and the benches' `weight_sync_method` text."""
        ...

    def connect(self, peers: SyncPeers) -> None: ...

    def collect(self, pushed: Sequence[PushStats], engines: EngineShards) -> list[int | None]:
        """After every policy rank pushed: the tensors each engine shard loaded."""
        ...
