"""The broadcast group of a weight sync: policy rank 0 (rank 0) and every engine shard (1 + i).

It is separate from the training group and built from its own TCPStore (rank 0 serves the store
it opened with `reserve_port`, if it did). Every wait is bounded (`GroupSpec.timeout_s`): a dead
peer raises instead of hanging. `check_group` sends one byte so NCCL forms its communicator at
setup and a broken group fails there.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from rlhfkit.parallel.rendezvous import held_store

DEFAULT_TIMEOUT_S = 120.0
_CHECK = 0x5A  # the rendezvous broadcast's byte


@dataclass(frozen=True)
class GroupSpec:
    """How to form the broadcast group (sent to every member)."""

    host: str
    port: int
    world_size: int
    backend: str  # gloo | nccl
    local: bool = True  # every member on this host: gloo binds 127.0.0.1
    timeout_s: float = DEFAULT_TIMEOUT_S

    def buffer_device(self, device: str) -> str:
        """Where a member's bucket buffer lives: its device under NCCL, host memory under gloo."""
        return device if self.backend == "nccl" else "cpu"


def make_group(spec: GroupSpec, rank: int) -> tuple[Any, Any]:
    """(store, process group) of `spec` for `rank`, without touching the default process group."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = held_store(spec.port, spec.timeout_s) if rank == 0 else None
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, None, rank == 0, timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore("rlhfkit_weight_sync", store)
    pg: C10dBackend
    if spec.backend == "nccl":
        try:
            # torch's stub lists only the options overload of ProcessGroupNCCL.__init__
            pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, timeout=timeout)  # type: ignore[call-arg]
        except TypeError:  # a build without the timeout overload: the options one
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
    elif spec.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stub calls it Options
        opts._timeout = timeout
        dev = (dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if spec.local
               else dist.ProcessGroupGloo.create_default_device())
        opts._devices = [dev]
        pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, opts)
    else:
        raise ValueError(f"weight sync backend must be gloo or nccl, got {spec.backend!r}")
    return store, pg


def broadcast(pg: Any, tensor: torch.Tensor, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    pg.broadcast([tensor], opts).wait()


def check_group(pg: Any, rank: int, device: str) -> None:
    """One byte from rank 0 to all: forms NCCL's communicator now and proves the group works."""
    t = torch.full((1,), _CHECK if rank == 0 else 0, dtype=torch.uint8, device=device)
    broadcast(pg, t)
    if int(t.item()) != _CHECK:
        raise RuntimeError(f"weight sync group: rank {rank} received {int(t.item())}, expected {_CHECK}")
