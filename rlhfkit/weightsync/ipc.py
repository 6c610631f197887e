"""CUDA IPC transport, for engines colocated with the policy (`--colocate_all_models` on GPUs).

Engine shard i shares a GPU with policy rank `sources[i]`, which already holds the gathered full
tensors: that rank packs each bucket on its GPU and sends a CUDA IPC handle of it
(`torch.multiprocessing.reductions.reduce_tensor`) through Ray; the engine opens it and copies
from it in place. No byte crosses a PCIe / NVLink link.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from rlhfkit.weightsync.buckets import Named, TensorMeta, pack_bucket, unpack_bucket
from rlhfkit.weightsync.direct import DirectSender, collect_direct, enter_device, finish_on
from rlhfkit.weightsync.protocol import ActorHandle, EngineShards, PushStats, SyncPeers


def ipc_handle(t: torch.Tensor) -> tuple[Any, tuple]:
    """A picklable handle of CUDA tensor `t` (the sender keeps `t` alive until the receiver is done)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda:
        raise ValueError("CUDA IPC needs a CUDA tensor")
    return reduce_tensor(t)


def open_ipc(handle: tuple[Any, tuple], device: str) -> torch.Tensor:
    """The sender's tensor, opened in this process on `device` (the same physical GPU: Ray may
    number it differently here, so the device index is replaced by ours)."""
    fn, packed = handle
    args = list(packed)
    if len(args) > 6 and isinstance(args[6], int):
        args[6] = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    return fn(*args)


@dataclass
class IpcChannel:
    name: ClassVar[str] = "ipc"
    _device: str = field(default="cuda", init=False)

    def open(self, device: str) -> None:
        self._device = device

    def send(self, bucket: list[Named], cast: torch.dtype | None, engines: list[ActorHandle],
             timeout_s: float) -> list[int]:
        import ray

        flat, metas = pack_bucket(bucket, self._device, cast)
        handle = ipc_handle(flat)
        counts = ray.get([e.load_bucket.remote(metas, handle) for e in engines], timeout=timeout_s)
        del flat  # the engines copied and synchronized before answering
        return counts

    def after_push(self) -> None:
        torch.cuda.ipc_collect()


@dataclass
class IpcReceiver:
    _device: str = field(default="cuda", init=False)
    _held: torch.Tensor | None = field(default=None, init=False, repr=False)

    def open(self, device: str) -> None:
        self._device = device

    def receive(self, metas: Sequence[TensorMeta], payload: Any) -> list[Named]:
        enter_device(self._device)
        flat = open_ipc(payload, self._device)
        self._held = flat
        return unpack_bucket(flat, metas)

    def done(self) -> None:
        finish_on(self._device)
        self._held = None


@dataclass(frozen=True)
class IpcTransport:
    sources: tuple[int, ...]  # engine shard i reads from policy rank sources[i]
    reason: str = ""
    name: ClassVar[str] = "ipc"

    def describe(self) -> str:
        return self.name + (f" ({self.reason})" if self.reason else "")

    def connect(self, peers: SyncPeers) -> None:
        targets: dict[int, dict[int, ActorHandle]] = {}
        for i, r in enumerate(self.sources):
            targets.setdefault(r, {})[i] = peers.engines[i]
        senders = [DirectSender(IpcChannel(), targets.get(r, {}), peers.timeout_s) for r in range(len(peers.policy))]
        peers.install(senders, [IpcReceiver() for _ in peers.engines])

    def collect(self, pushed: Sequence[PushStats], engines: EngineShards) -> list[int | None]:
        return collect_direct(pushed, engines)
