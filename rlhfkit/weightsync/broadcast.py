"""Broadcast transport: policy rank 0 broadcasts each bucket to every engine shard over a process
group of 1 + num_shards ranks (collective.py), NCCL or gloo.

Rank 0 sends each bucket's metadata through Ray (`EngineWorker.load_bucket.remote(metas, size)`,
so the engines enter the collective), then broadcasts the bytes. NCCL when policy rank 0 and every
engine are on CUDA and no engine shares rank 0's GPU, else gloo (CPU buffers; a CUDA engine
copies to its GPU). The other policy ranks only take part in the gathering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from rlhfkit.weightsync.buckets import Named, TensorMeta, pack_bucket, unpack_bucket
from rlhfkit.weightsync.collective import GroupSpec, broadcast, check_group, make_group
from rlhfkit.weightsync.direct import DirectSender, collect_direct, enter_device, finish_on
from rlhfkit.weightsync.protocol import ActorHandle, EngineShards, PushStats, SyncPeers


@dataclass
class BroadcastChannel:
    """Policy rank 0's end of the group."""

    group: GroupSpec
    name: ClassVar[str] = "broadcast"
    _pg: Any = field(default=None, init=False, repr=False)
    _store: Any = field(default=None, init=False, repr=False)
    _device: str = field(default="cpu", init=False)

    def open(self, device: str) -> None:
        self._device = self.group.buffer_device(device)
        self._store, self._pg = make_group(self.group, 0)
        check_group(self._pg, 0, self._device)

    def send(self, bucket: list[Named], cast: torch.dtype | None, engines: list[ActorHandle],
             timeout_s: float) -> list[int]:
        import ray

        flat, metas = pack_bucket(bucket, self._device, cast)
        refs = [e.load_bucket.remote(metas, flat.numel()) for e in engines]  # receivers enter first
        broadcast(self._pg, flat)
        return ray.get(refs, timeout=timeout_s)

    def after_push(self) -> None:
        pass


@dataclass
class BroadcastReceiver:
    """Engine shard `rank` (1 + its index) of the group."""

    group: GroupSpec
    rank: int
    _pg: Any = field(default=None, init=False, repr=False)
    _store: Any = field(default=None, init=False, repr=False)
    _device: str = field(default="cpu", init=False)
    _held: torch.Tensor | None = field(default=None, init=False, repr=False)

    def open(self, device: str) -> None:
        self._device = device
        self._store, self._pg = make_group(self.group, self.rank)
        check_group(self._pg, self.rank, self.group.buffer_device(device))

    def receive(self, metas: Sequence[TensorMeta], payload: Any) -> list[Named]:
        enter_device(self._device)
        flat = torch.empty(int(payload), dtype=torch.uint8, device=self.group.buffer_device(self._device))
        broadcast(self._pg, flat)
        self._held = flat
        return unpack_bucket(flat, metas)

    def done(self) -> None:
        finish_on(self._device)
        self._held = None


@dataclass(frozen=True)
class BroadcastTransport:
    backend: str  # nccl | gloo
    reason: str = ""
    name: ClassVar[str] = "broadcast"

    def describe(self) -> str:
        return f"{self.name} over {self.backend}" + (f" ({self.reason})" if self.reason else "")

    def connect(self, peers: SyncPeers) -> None:
        [port] = peers.wait([peers.policy[0].reserve_port.remote()], [("policy", 0)])
        local = len({*peers.policy_ips[:1], *peers.engine_ips}) == 1
        group = GroupSpec("127.0.0.1" if local else peers.policy_ips[0], port, 1 + len(peers.engines), self.backend,
                          local=local, timeout_s=peers.timeout_s)
        channel = BroadcastChannel(group)
        senders = [DirectSender(channel, dict(enumerate(peers.engines)) if r == 0 else {}, peers.timeout_s)
                   for r in range(len(peers.policy))]
        peers.install(senders, [BroadcastReceiver(group, 1 + i) for i in range(len(peers.engines))])

    def collect(self, pushed: Sequence[PushStats], engines: EngineShards) -> list[int | None]:
        return collect_direct(pushed, engines)
