"""A seeded, rank-sharded, epoch-aware sampler that resumes exactly where it stopped.

Each epoch has one global order of the dataset indices (a permutation seeded with
`seed + epoch`, as `torch.utils.data.DistributedSampler` does), cut to a multiple of the
world size (`drop_last`) or padded by wrapping around. Rank r reads positions r, r + W,
r + 2W, ... of it, so consecutive global batches of `W * micro_batch` positions are split
into disjoint per-rank slices that together cover the batch:

    global order:   o0 o1 o2 o3 | o4 o5 o6 o7 | ...      (W = 2, micro batch 2)
    rank 0:         o0 o2       | o4 o6
    rank 1:            o1 o3    |    o5 o7

`consumed` counts global positions handed out in the current epoch; `state_dict()` saves
`(epoch, consumed)` and `load_state_dict` restores them, so a resumed run continues with
exactly the samples an uninterrupted run would see (also with another world size, as long as it
divides `consumed`, so that every rank still gets the same number of indices).
The count advances when an index is handed out; with DataLoader worker prefetching, save the
trainer's own count instead (`load_state_dict({"epoch": e, "consumed": n})`).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler[int]):
    """DistributedSampler semantics plus exact mid-epoch resume."""

    def __init__(self, num_samples: int, world_size: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        if drop_last and num_samples < world_size:
            raise ValueError(f"{num_samples} samples cannot give each of {world_size} ranks one sample")
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0
        self._pass_done = False  # the last __iter__ ran to its end (a new one starts the epoch over)

    @property
    def total_size(self) -> int:
        """Global positions per epoch (a multiple of the world size)."""
        w = self.world_size
        return (self.num_samples // w) * w if self.drop_last else math.ceil(self.num_samples / w) * w

    def __len__(self) -> int:
        """Indices this rank yields in a full epoch."""
        return self.total_size // self.world_size

    def global_order(self, epoch: int | None = None) -> list[int]:
        """The epoch's global index order (all ranks), after drop/pad."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        while len(order) < self.total_size:
            order += order[: self.total_size - len(order)]
        return order[: self.total_size]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch`; the same epoch as the current one keeps the resume position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self._pass_done = False

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        if self._pass_done:  # iterating a finished epoch again replays it, like DistributedSampler
            self.consumed = 0
        self._pass_done = False
        for pos in range(self.consumed + self.rank, self.total_size, self.world_size):
            self.consumed = pos - self.rank + self.world_size
            yield order[pos]
        self._pass_done = True

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `(epoch, consumed)`; a checkpoint of a different dataset or seed is refused."""
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler checkpoint has {key}={state[key]!r} but this run has "
                                 f"{getattr(self, key)!r}; resuming would not replay the same samples")
        consumed = int(state["consumed"])
        if consumed % self.world_size:
            raise ValueError(f"sampler checkpoint consumed={consumed} is not a multiple of the "
                             f"world size {self.world_size}; ranks would overlap")
        self.epoch = int(state["epoch"])
        self.consumed = consumed
        self._pass_done = False  # resumed at the end of an epoch: nothing left in it
