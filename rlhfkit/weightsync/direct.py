"""The push loop of the direct transports (broadcast, CUDA IPC): bucket by bucket to the engines.

All policy ranks iterate the full parameters together (FSDP2 all-gathers, so every rank must
iterate to the end); the ranks with engine targets hand each bucket to them through their
`Channel`, one bucket at a time: the sender waits for every engine's answer (loaded, device
synchronized) before the next bucket, so one bucket is in flight and an IPC buffer is released
only after its last use. Every wait is bounded (`timeout_s`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Protocol, Sequence

import torch

from rlhfkit.weightsync.buckets import Named, iter_buckets, sent_nbytes
from rlhfkit.weightsync.collective import DEFAULT_TIMEOUT_S
from rlhfkit.weightsync.protocol import ActorHandle, EngineShards, PushStats


class Channel(Protocol):
    """How one bucket reaches a sender's engines."""

    name: ClassVar[str]

    def open(self, device: str) -> None: ...

    def send(self, bucket: list[Named], cast: torch.dtype | None, engines: list[ActorHandle],
             timeout_s: float) -> list[int]:
        """Hand `bucket` to `engines` (`EngineWorker.load_bucket`); the tensors each loaded."""
        ...

    def after_push(self) -> None: ...


@dataclass
class DirectSender:
    """A policy rank's `WeightSender` for broadcast / IPC: `targets` maps engine shard index -> actor
    (empty: the rank only takes part in the gathering)."""

    channel: Channel
    targets: dict[int, ActorHandle] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S

    def open(self, device: str) -> None:
        if self.targets:
            self.channel.open(device)

    def push(self, named: Iterable[Named], cast: torch.dtype | None, bucket_bytes: int) -> PushStats:
        t0 = time.perf_counter()
        stats = PushStats(self.channel.name, engine_tensors={i: 0 for i in self.targets})
        engines = list(self.targets.values())
        for bucket in iter_buckets(named, bucket_bytes, cast):
            if not engines:
                continue  # this rank only takes part in the gathering
            counts = self.channel.send(bucket, cast, engines, self.timeout_s)
            for i, c in zip(self.targets, counts, strict=True):
                stats.engine_tensors[i] += c
            stats.buckets += 1
            stats.bytes += sum(sent_nbytes(t, cast) for _, t in bucket)
        if engines:
            self.channel.after_push()
        stats.seconds = time.perf_counter() - t0
        return stats


def collect_direct(pushed: Sequence[PushStats], engines: EngineShards) -> list[int | None]:
    """Per engine shard, the tensors it loaded (None: no policy rank sent to it)."""
    merged: dict[int, int] = {}
    for s in pushed:
        merged.update(s.engine_tensors)
    return [merged.get(i) for i in range(len(engines.shards))]


def enter_device(device: str) -> None:
    """A receiver's thread works on the engine's GPU (the current device is per thread)."""
    if device.startswith("cuda") and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))


def finish_on(device: str) -> None:
    """After the engine copied a bucket: wait for the copies (the sender may free its buffer once
    the engine answers)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))
