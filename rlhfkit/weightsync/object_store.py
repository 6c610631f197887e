"""Object-store transport, the fallback (and vLLM's path): policy rank 0 leaves CPU buckets in
Ray's object store; every engine shard fetches them all and copies its slices
(`EngineWorker.update_weights(refs)`, through `RayEngineRouter.load_from_object_store`).

`put_buckets` is also the router's own `update_weights(named)` (the RolloutEngine protocol).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Sequence

import torch

from rlhfkit.weightsync.buckets import Named, iter_buckets, target_dtype
from rlhfkit.weightsync.protocol import EngineShards, PushStats, SyncPeers


def put_buckets(named: Iterable[Named], bucket_bytes: int, cast: torch.dtype | None = None,
                publish: bool = True) -> tuple[list[Any], int]:
    """(object refs of CPU buckets, their bytes); `publish` False only consumes `named` (a rank
    that takes part in FSDP2's gathering): ([], 0)."""
    import ray

    refs: list[Any] = []
    total = 0
    for bucket in iter_buckets(named, bucket_bytes, cast):
        if not publish:
            continue
        host = [(n, t.detach().to("cpu", dtype=target_dtype(t, cast))) for n, t in bucket]
        total += sum(t.numel() * t.element_size() for _, t in host)
        refs.append(ray.put(host))
    return refs, total


@dataclass
class ObjectStoreSender:
    """A policy rank's `WeightSender`: rank 0 publishes, the others only gather."""

    publish: bool
    name: ClassVar[str] = "object_store"

    def open(self, device: str) -> None:
        pass

    def push(self, named: Iterable[Named], cast: torch.dtype | None, bucket_bytes: int) -> PushStats:
        t0 = time.perf_counter()
        refs, nbytes = put_buckets(named, bucket_bytes, cast, self.publish)
        return PushStats(self.name, bytes=nbytes, buckets=len(refs), seconds=time.perf_counter() - t0, refs=refs)


@dataclass(frozen=True)
class ObjectStoreTransport:
    reason: str = ""
    name: ClassVar[str] = "object_store"

    def describe(self) -> str:
        return self.name + (f" ({self.reason})" if self.reason else "")

    def connect(self, peers: SyncPeers) -> None:
        peers.install([ObjectStoreSender(publish=r == 0) for r in range(len(peers.policy))])

    def collect(self, pushed: Sequence[PushStats], engines: EngineShards) -> list[int | None]:
        return list(engines.load_from_object_store(pushed[0].refs))
