"""Process-group setup and the few collectives the rest of rlhfkit needs.

`init_distributed(device)` looks at the launcher's environment:

* under torchrun (`RANK` and `WORLD_SIZE` set) it initialises the default process group,
  gloo on CPU; on CUDA NCCL for GPU tensors plus gloo for CPU tensors ("cpu:gloo,cuda:nccl",
  which FSDP2's CPU offload needs for its gradient-norm reduction), one GPU per local rank;
* when a process group already exists (e.g. a Ray actor that set one up itself) it reuses it;
* otherwise it returns a single-process `DistInfo` and creates no process group at all, so
  one-process CPU runs pay nothing for distribution.

The helpers (`all_reduce_sum`, `barrier`, `is_rank0`, `broadcast_object`) are no-ops without a
process group, so the same code runs in one process and under torchrun.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, rank on this host, torch device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def has_process_group(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def resolve_device(device: str | None) -> str:
    """`None` -> "cuda" when available else "cpu"; validate anything else (flag `--device`)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (optionally cuda:N), got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for but CUDA is not available")
    return device


def init_distributed(device: str | None = None, timeout_minutes: int = 60) -> DistInfo:
    """Initialise (or reuse) the default process group when launched by torchrun.

    Returns `DistInfo`; `device` is "cpu" or "cuda:<local_rank>" (the GPU is also made current).
    """
    device = resolve_device(device)
    on_cuda = device.startswith("cuda")
    env_world = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not env_world and not (dist.is_available() and dist.is_initialized()):
        if on_cuda and ":" not in device:
            device = f"cuda:{torch.cuda.current_device()}"
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_cuda:
        ndev = torch.cuda.device_count()
        if ":" not in device:
            device = f"cuda:{local_rank % ndev}"
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        kw: dict[str, Any] = {"timeout": datetime.timedelta(minutes=timeout_minutes)}
        if on_cuda:
            kw["device_id"] = torch.device(device)
        # On CUDA, gloo serves CPU tensors (FSDP2 CPU offload, CPU-side collectives).
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if on_cuda else "gloo", **kw)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=local_rank, device=device)


def init_single_rank_group(device: str) -> None:
    """A default process group of one rank over an in-memory store (no network), for a feature
    that needs one in a single process (FSDP2's CPUOffloadPolicy under --adam_offload)."""
    if dist.is_initialized():
        return
    on_cuda = device.startswith("cuda")
    kw: dict[str, Any] = {"device_id": torch.device(device)} if on_cuda else {}
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if on_cuda else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1, **kw)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """True when a default process group exists (torchrun / Ray group of several ranks)."""
    return _active()


def _comm_device() -> torch.device:
    """The device collectives of the default group run on (NCCL: the current GPU)."""
    if _active() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_rank() -> int:
    return dist.get_rank() if _active() else 0


def get_world_size() -> int:
    return dist.get_world_size() if _active() else 1


def is_rank0() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if _active():
        dist.barrier()


def all_reduce_sum(x: T) -> T:
    """Sum a tensor or a Python number over all ranks (returns a new object; no-op in one process)."""
    if not _active():
        return x
    if isinstance(x, torch.Tensor):
        t = x.detach().to(_comm_device(), copy=True)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.to(x.device)  # type: ignore[return-value]
    if isinstance(x, (int, float)):
        dtype = torch.int64 if isinstance(x, int) and not isinstance(x, bool) else torch.float64
        t = torch.tensor(x, dtype=dtype, device=_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.item()  # type: ignore[return-value]
    raise TypeError(f"all_reduce_sum takes a tensor, int or float, got {type(x).__name__}")


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s picklable `obj` on every rank (no-op in one process)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]
