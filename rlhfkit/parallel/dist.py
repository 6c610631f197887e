"""Process-group setup and the few collectives the rest of rlhfkit needs.

`init_distributed(device)` looks at the launcher's environment:

* under torchrun (`RANK` and `WORLD_SIZE` set) it initialises the default process group,
  gloo on CPU; on CUDA NCCL for GPU tensors plus gloo for CPU tensors ("cpu:gloo,cuda:nccl",
  which FSDP2's CPU offload needs for its gradient-norm reduction), one GPU per local rank;
* when a process group already exists (e.g. a Ray actor that set one up itself) it reuses it;
* otherwise it returns a single-process `DistInfo` and creates no process group at all, so
  one-process CPU runs pay nothing for distribution.

The helpers (`all_reduce_sum`, `barrier`, `is_rank0`, `broadcast_object`) are no-ops without a
process group, so the same code runs in one process and under torchrun. They go over the whole
world; the backend uses them for decisions every rank must share (skip a step, a checkpoint path).

Reductions of data (losses, token and sample counts, metrics, whitening statistics) go through
`DistInfo`'s scoped helpers instead, which know the training mesh (`MeshGroups`, attached by
`rlhfkit.parallel.mesh.attach_mesh`):

    dist.all_reduce_dp(x)     over the data-parallel ranks (dp_replicate x dp_shard): quantities
                              of whole rows (samples, rewards, full-row token counts); the tp and
                              cp ranks of one dp rank hold the same rows and are left out
    dist.all_reduce_loss(x)   over the loss group: quantities computed from the model's output
                              (loss values, per-token metric means). It is the dp group: under
                              context parallelism the backend gathers the per-token outputs over
                              the ring (parallel/context_parallel.py), so every cp rank computes the
                              whole loss of its dp rank's rows
    dist.all_reduce_world(x)  over every rank: control-flow decisions (e.g. the number of
                              micro-batches, skip a step), which must agree on all ranks
    dist.broadcast_replica(o) from the first rank of this dp rank's tp x cp group to the others
                              (RL: all of them train on the trajectories one of them sampled)

Without a mesh (or with tp = cp = 1) the dp and loss groups are the default group (`None`), so
nothing changes in behaviour or speed. tests/unit/test_no_unscoped_collectives.py keeps roles/,
trainers/, algo/, losses/ and data/ free of world-wide data reductions.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlhfkit.parallel.rendezvous import destroy_at_exit, held_store

T = TypeVar("T")


@dataclass(frozen=True)
class MeshGroups:
    """This rank's place in the training mesh and the process groups of its dimensions.

    A group of `None` is the default group (the whole world); a dimension of size 1 has no group
    (nothing to reduce). `dims` is the `ParallelDims` the groups were built from."""

    dims: Any
    device_mesh: Any = None  # the named DeviceMesh (shared with the FSDP2 backend), None in one process
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    loss_rank: int = 0  # within dp x cp
    loss_size: int = 1
    loss_group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None
    replica_size: int = 1  # tp x cp: the ranks that hold this dp rank's rows
    replica_src: int = 0  # global rank of the first of them
    replica_group: Any = None


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, rank on this host, torch device, and
    (with `mesh`) its data-parallel rank and the process groups of the training mesh."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    mesh: MeshGroups | None = field(default=None, compare=False, repr=False)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def has_process_group(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    # ------------------------------------------------------------------ data-parallel view

    @property
    def dp_rank(self) -> int:
        """Which share of the data this rank trains on (the global rank without a mesh)."""
        return self.mesh.dp_rank if self.mesh is not None else self.rank

    @property
    def dp_size(self) -> int:
        """Into how many shares the data is cut (the world size without a mesh)."""
        return self.mesh.dp_size if self.mesh is not None else self.world_size

    @property
    def dp_group(self) -> Any:
        return self.mesh.dp_group if self.mesh is not None else None

    @property
    def loss_size(self) -> int:
        """Ranks of the loss group (dp x cp); the world size without a mesh."""
        return self.mesh.loss_size if self.mesh is not None else self.world_size

    @property
    def loss_group(self) -> Any:
        return self.mesh.loss_group if self.mesh is not None else None

    # ------------------------------------------------------------------ scoped collectives

    def all_reduce_dp(self, x: T, op: str = "sum") -> T:
        """`x` (tensor, int or float) reduced over the data-parallel ranks (see the module docstring)."""
        return _all_reduce(x, op, self.dp_group, self.mesh.dp_size if self.mesh is not None else get_world_size())

    def all_reduce_loss(self, x: T, op: str = "sum") -> T:
        """`x` reduced over dp x cp: values computed from the model's output on this rank's tokens."""
        return _all_reduce(x, op, self.loss_group, self.mesh.loss_size if self.mesh is not None else get_world_size())

    def all_reduce_world(self, x: T, op: str = "sum") -> T:
        """`x` reduced over every rank: for decisions all ranks must take together."""
        return _all_reduce(x, op, None, get_world_size())

    def agree(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any (a decision every rank takes together)."""
        return bool(self.all_reduce_world(int(flag), op="max"))

    def from_rank0(self, obj: T) -> T:
        """Rank 0's picklable `obj` on every rank: a decision all ranks take together (which checkpoint
        to resume from), never data."""
        return broadcast_object(obj)

    def broadcast_replica(self, obj: T) -> T:
        """The first rank's `obj` on every rank of this dp rank's tp x cp group (no-op when it is one rank)."""
        m = self.mesh
        if m is None or m.replica_size == 1 or not _active():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=m.replica_src, group=m.replica_group, device=_comm_device())
        return box[0]


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


def with_index(device: str) -> str:
    """"cuda" -> "cuda:<current device>" (what `torch.cuda.set_device` and NCCL need); anything else unchanged.
    A Ray actor sees only its own GPUs, so the current device is the one it was given."""
    return f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def use_expandable_segments(device: str) -> None:
    """On a GPU `device`, the caching allocator of this process grows its segments in place (expandable
    segments) unless the user's PYTORCH_CUDA_ALLOC_CONF says otherwise. A trainer's allocations change shape
    every micro-batch (token budgets, gathered blocks, the engine's KV cache beside them): without it the
    allocator keeps gigabytes of free blocks of the wrong sizes, which the memory plan
    (rlhfkit/distributed/memory_plan.py) does not count. Applies to this process's allocations that follow,
    also after CUDA was first touched.
    Not for a process that runs vLLM: its sleep mode's memory pool refuses expandable segments."""
    if not device.startswith("cuda") or ALLOC_CONF in os.environ:
        return
    try:
        set_settings = torch._C._accelerator_setAllocatorSettings  # torch >= 2.9
    except AttributeError:
        set_settings = torch.cuda.memory._set_allocator_settings
    set_settings("expandable_segments:True")


def init_distributed(device: str | None = None, timeout_minutes: int = 60) -> DistInfo:
    """Initialise (or reuse) the default process group when launched by torchrun.

    Returns `DistInfo`; `device` is "cpu" or "cuda:<local_rank>" (the GPU is also made current).
    """
    device = resolve_device(device)
    on_cuda = device.startswith("cuda")
    env_world = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not env_world and not (dist.is_available() and dist.is_initialized()):
        return DistInfo(rank=0, world_size=1, local_rank=0, device=with_index(device))

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
        # rank 0 of a group rlhfkit formed itself serves the store it opened on a kernel-picked port
        # (rendezvous.reserve_port); the other ranks reach it through env:// as under torchrun
        store = held_store(int(os.environ.get("MASTER_PORT", "0"))) if os.environ.get("RANK") == "0" else None
        if store is not None:
            kw.update(store=dist.PrefixStore("default_pg", store), rank=0, world_size=int(os.environ["WORLD_SIZE"]))
        # On CUDA, gloo serves CPU tensors (FSDP2 CPU offload, CPU-side collectives).
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if on_cuda else "gloo", **kw)
        destroy_at_exit()
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


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def _all_reduce(x: T, op: str, group: Any, size: int) -> T:
    """`x` reduced with `op` over `group` (None: the default group) of `size` ranks; a new object."""
    if op not in _OPS:
        raise ValueError(f"reduce op must be one of {sorted(_OPS)}, got {op!r}")
    if not _active() or size == 1:
        return x
    red = getattr(dist.ReduceOp, _OPS[op])
    if isinstance(x, torch.Tensor):
        t = x.detach().to(_comm_device(), copy=True)
        dist.all_reduce(t, op=red, group=group)
        return t.to(x.device)  # type: ignore[return-value]
    if isinstance(x, (int, float)):
        dtype = torch.int64 if isinstance(x, int) and not isinstance(x, bool) else torch.float64
        t = torch.tensor(x, dtype=dtype, device=_comm_device())
        dist.all_reduce(t, op=red, group=group)
        return t.item()  # type: ignore[return-value]
    raise TypeError(f"all-reduce takes a tensor, int or float, got {type(x).__name__}")


def all_reduce_sum(x: T) -> T:
    """Sum a tensor or a Python number over all ranks (returns a new object; no-op in one process)."""
    if not _active():
        return x
    return _all_reduce(x, "sum", None, get_world_size())


def all_reduce_max(x: T) -> T:
    """The largest value of a tensor or a Python number over all ranks (a new object; no-op in one process)."""
    if not _active():
        return x
    return _all_reduce(x, "max", None, get_world_size())


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s picklable `obj` on every rank (no-op in one process)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's picklable `obj`, in rank order, on every rank ([obj] in one process)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out
