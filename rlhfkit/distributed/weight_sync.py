"""Direct weight sync from the policy to the rollout engines: broadcast (gloo / NCCL) or CUDA IPC.

After each step the policy group's ranks iterate the full parameters together (FSDP2 all-gathers,
so every rank must iterate to the end); the sending ranks pack them into flat byte buckets of at
most `bucket_bytes` and hand each bucket straight to the engines:

    broadcast  a process group of 1 + num_engines ranks, separate from the training group (policy
               rank 0 is rank 0, engine i is rank 1 + i), built from its own TCPStore; rank 0
               sends each bucket's metadata through Ray (`EngineWorker.load_bucket.remote`, so the
               engines enter the collective), then broadcasts the bytes. NCCL when policy rank 0
               and every engine are on CUDA and no engine shares rank 0's GPU, else gloo (CPU
               buffers; a CUDA engine copies to its GPU).
    ipc        colocated (`--colocate_all_models` on GPUs): engine i shares a GPU with policy rank
               i, which already holds the gathered full tensors; rank i sends a CUDA IPC handle of
               its GPU bucket (`torch.multiprocessing.reductions.reduce_tensor`) through Ray and the
               engine copies from it in place. No byte crosses a PCIe / NVLink link.
    object_store  the fallback: CPU buckets in Ray's object store (`RoleWorker.publish_weights`).

Bucket layout (`pack_bucket` / `unpack_bucket`): one uint8 tensor; tensor k's bytes start at
`TensorMeta.offset`, aligned to `ALIGN` bytes so every dtype view is aligned; a name whose tensor
aliases an earlier one (tied embeddings) points at the same bytes and costs nothing. The metadata
(name, shape, dtype, offset, nbytes) travels through Ray; the bytes go through the group
(broadcast) or stay on the GPU (IPC: only the handle travels). One bucket at a time: the sender
waits for every engine's answer (loaded, device synchronized) before the next bucket, so one
bucket is in flight and an IPC buffer is released only after its last use. Every wait is bounded
(`timeout_s`, 120 s by default): a dead peer raises instead of hanging.

`choose_method` is the selection (`--weight_sync auto|object_store|broadcast|ipc`); a fallback
always comes with its reason, which the CLI prints.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from rlhfkit.backend.rendezvous import held_store
from rlhfkit.backend.sharding import group_by_bytes

METHODS = ("auto", "object_store", "broadcast", "ipc")
ALIGN = 64  # bytes; >= every dtype's element size, and a cache-line multiple
DEFAULT_TIMEOUT_S = 120.0
_CHECK = 0x5A  # the rendezvous broadcast's byte


# ----------------------------------------------------------------------------- bucket layout


@dataclass(frozen=True)
class TensorMeta:
    """Where one named tensor lies in a flat bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    offset: int  # bytes
    nbytes: int


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight sync metadata names an unknown dtype {name!r}")
    return dt


def _target_dtype(t: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and t.is_floating_point() else t.dtype


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]], device: torch.device | str = "cpu",
                cast: torch.dtype | None = None) -> tuple[torch.Tensor, list[TensorMeta]]:
    """`named` -> (flat uint8 tensor on `device`, metadata). Floating tensors are cast to `cast`
    (when given); a tensor aliasing an earlier one (same storage, offset, shape, strides) is stored once."""
    metas: list[TensorMeta] = []
    seen: dict[tuple, TensorMeta] = {}
    sources: list[tuple[torch.Tensor, TensorMeta]] = []
    size = 0
    for name, t in named:
        t = t.detach()
        key = _alias_key(t)
        if key in seen:
            first = seen[key]
            metas.append(TensorMeta(name, first.shape, first.dtype, first.offset, first.nbytes))
            continue
        dt = _target_dtype(t, cast)
        nbytes = t.numel() * torch.empty((), dtype=dt).element_size()
        meta = TensorMeta(name, tuple(t.shape), str(dt).removeprefix("torch."), size, nbytes)
        seen[key] = meta
        metas.append(meta)
        sources.append((t, meta))
        size = _round_up(size + nbytes)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    for t, meta in sources:
        if meta.nbytes:
            src = t.to(dtype=_dtype(meta.dtype)).contiguous().reshape(-1).view(torch.uint8)
            flat[meta.offset:meta.offset + meta.nbytes].copy_(src)
    return flat, metas


def unpack_bucket(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of `flat` (uint8) named as in `metas`; aliased names share their bytes."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a weight bucket is a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    out = []
    for m in metas:
        if m.offset + m.nbytes > flat.numel():
            raise ValueError(f"weight {m.name!r}: bytes [{m.offset}, {m.offset + m.nbytes}) exceed the "
                             f"bucket's {flat.numel()}")
        out.append((m.name, flat[m.offset:m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)))
    return out


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 cast: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive lists of at most `bucket_bytes` (after the cast; a larger tensor goes alone).
    Consumes `named` to the end, which FSDP2's gathering needs on every rank."""
    if bucket_bytes <= 0:
        raise ValueError(f"--weight_sync_bucket_mb must be > 0 (got {bucket_bytes} bytes)")
    yield from group_by_bytes(named, bucket_bytes, lambda t: _round_up(t.numel() * _target_dtype(t, cast).itemsize))


# ----------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Endpoint:
    """Where an actor runs: node, Ray GPU ids (empty on CPU) and torch device."""

    node: str
    gpu_ids: tuple[str, ...]
    device: str

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def shares_gpu(self, other: "Endpoint") -> bool:
        return self.cuda and other.cuda and self.node == other.node and bool(set(self.gpu_ids) & set(other.gpu_ids))


@dataclass(frozen=True)
class SyncChoice:
    method: str  # object_store | broadcast | ipc
    backend: str | None = None  # gloo | nccl for broadcast
    reason: str = ""
    ipc_source: tuple[int, ...] = ()  # engine i reads from policy rank ipc_source[i]

    def describe(self) -> str:
        how = self.method + (f" over {self.backend}" if self.backend else "")
        return how + (f" ({self.reason})" if self.reason else "")


def choose_method(requested: str, policy: Sequence[Endpoint], engines: Sequence[Endpoint], *,
                  engine_direct: bool = True, backend: str = "nccl") -> SyncChoice:
    """The sync path for `--weight_sync requested`; see the module docstring. `engine_direct` is
    False for engines with their own loading path (vLLM); `backend` is --vllm_sync_backend."""
    if requested not in METHODS:
        raise ValueError(f"--weight_sync {requested!r}: choose one of {', '.join(METHODS)}")
    if requested == "object_store":
        return SyncChoice("object_store")
    if not engine_direct:
        return SyncChoice("object_store", reason=f"--weight_sync {requested} falls back: vLLM engines load "
                                                 "weights through their own path")
    source = tuple(next((r for r, p in enumerate(policy) if p.shares_gpu(e)), -1) for e in engines)
    colocated = bool(engines) and all(s >= 0 for s in source)
    note = ""
    if requested in ("ipc", "auto") and colocated:
        return SyncChoice("ipc", reason="auto: every engine shares a GPU with a policy rank" if requested == "auto"
                          else "", ipc_source=source)
    if requested == "ipc":
        note = "--weight_sync ipc falls back: it needs every engine on the GPU of a policy rank " \
               "(--colocate_all_models on GPUs)"
    rank0 = policy[0]
    if not (rank0.cuda and all(e.cuda for e in engines)):
        why = "gloo: the policy or an engine is on CPU" + (" (--vllm_sync_backend nccl becomes gloo)"
                                                            if backend == "nccl" else "")
    elif any(rank0.shares_gpu(e) for e in engines):
        why = "gloo: an engine shares policy rank 0's GPU (NCCL needs one GPU per rank)"
    elif backend == "gloo":
        why = "gloo: --vllm_sync_backend gloo"
    else:
        return SyncChoice("broadcast", "nccl", note)
    return SyncChoice("broadcast", "gloo", "; ".join(x for x in (note, why) if x))


# ----------------------------------------------------------------------------- the process group


@dataclass(frozen=True)
class GroupSpec:
    """How to form the broadcast group (sent to every member)."""

    host: str
    port: int
    world_size: int
    backend: str  # gloo | nccl
    local: bool = True  # every member on this host: gloo binds 127.0.0.1
    timeout_s: float = DEFAULT_TIMEOUT_S


def make_group(spec: GroupSpec, rank: int) -> tuple[Any, Any]:
    """(store, process group) of `spec` for `rank`, without touching the default process group."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    # rank 0 (the policy's first rank) serves the store it opened with reserve_port, if it did
    store = held_store(spec.port, spec.timeout_s) if rank == 0 else None
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, None, rank == 0, timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore("rlhfkit_weight_sync", store)
    if spec.backend == "nccl":
        try:
            pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, timeout=timeout)
        except TypeError:  # a build without the timeout overload: the options one
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
    elif spec.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
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


def _buffer_device(backend: str | None, device: str) -> str:
    return device if backend == "nccl" or (backend is None and device.startswith("cuda")) else "cpu"


# ----------------------------------------------------------------------------- CUDA IPC


def ipc_handle(t: torch.Tensor) -> tuple[Any, tuple]:
    """A picklable handle of CUDA tensor `t` (the sender keeps `t` alive until the receiver is done)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda:
        raise ValueError("CUDA IPC needs a CUDA tensor")
    return reduce_tensor(t)


def open_ipc(handle: tuple[Any, tuple], device: str) -> torch.Tensor:
    """The sender's tensor, opened in this process on `device` (the same physical GPU: Ray may
    number it differently here, so the device index is replaced by ours)."""
    fn, args = handle
    args = list(args)
    if len(args) > 6 and isinstance(args[6], int):
        args[6] = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    return fn(*args)


# ----------------------------------------------------------------------------- both ends


@dataclass
class SenderPlan:
    """What one policy rank does in a sync: its engine actors (`targets`, engine index -> actor)."""

    method: str  # broadcast | ipc
    targets: dict[int, Any] = field(default_factory=dict)
    group: GroupSpec | None = None  # broadcast, rank 0 only
    timeout_s: float = DEFAULT_TIMEOUT_S  # for the engines' answers too


class WeightSender:
    """Policy-rank side: `push(named, cast, bucket_bytes)` after each step (all ranks call it)."""

    def __init__(self, plan: SenderPlan, device: str) -> None:
        self.plan, self.device = plan, device
        self.store = self.pg = None
        if plan.method == "broadcast" and plan.targets:
            if plan.group is None:
                raise ValueError("a broadcasting policy rank needs the group spec")
            self.store, self.pg = make_group(plan.group, 0)

    def check(self) -> None:
        if self.pg is not None:
            check_group(self.pg, 0, _buffer_device(self.plan.group.backend, self.device))

    def push(self, named: Iterable[tuple[str, torch.Tensor]], cast: torch.dtype | None,
             bucket_bytes: int) -> dict[str, Any]:
        import ray

        t0 = time.perf_counter()
        stats: dict[str, Any] = {"method": self.plan.method, "bytes": 0, "buckets": 0,
                                 "engine_tensors": {i: 0 for i in self.plan.targets}}
        for bucket in iter_buckets(named, bucket_bytes, cast):
            if not self.plan.targets:
                continue  # this rank only takes part in the gathering
            counts = self._send(bucket, cast, ray)
            for i, c in zip(self.plan.targets, counts, strict=True):
                stats["engine_tensors"][i] += c
            stats["buckets"] += 1
            stats["bytes"] += sum(t.numel() * torch.empty((), dtype=_target_dtype(t, cast)).element_size()
                                  for _, t in bucket)
        if self.plan.method == "ipc" and self.plan.targets:
            torch.cuda.ipc_collect()
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def _send(self, bucket: list[tuple[str, torch.Tensor]], cast: torch.dtype | None, ray: Any) -> list[int]:
        engines = list(self.plan.targets.values())
        if self.plan.method == "broadcast":
            flat, metas = pack_bucket(bucket, _buffer_device(self.plan.group.backend, self.device), cast)
            refs = [e.load_bucket.remote(metas, flat.numel()) for e in engines]  # receivers enter first
            broadcast(self.pg, flat)
            return ray.get(refs, timeout=self.plan.timeout_s)
        flat, metas = pack_bucket(bucket, self.device, cast)
        handle = ipc_handle(flat)
        counts = ray.get([e.load_bucket.remote(metas, handle) for e in engines], timeout=self.plan.timeout_s)
        del flat  # the engines copied and synchronized before answering
        return counts


class WeightReceiver:
    """Engine side: `receive(metas, payload)` -> (name, tensor) pairs to load, then `done()`."""

    def __init__(self, method: str, device: str, group: GroupSpec | None = None, rank: int = 0) -> None:
        self.method, self.device = method, device
        self.store = self.pg = None
        self.backend = group.backend if group is not None else None
        if method == "broadcast":
            if group is None:
                raise ValueError("a broadcast receiver needs the group spec")
            self.store, self.pg = make_group(group, rank)
            self.rank = rank
        elif method != "ipc":
            raise ValueError(f"no receiver for weight sync method {method!r}")
        self._held: torch.Tensor | None = None

    def check(self) -> None:
        if self.pg is not None:
            check_group(self.pg, self.rank, _buffer_device(self.backend, self.device))

    def _cuda(self) -> bool:
        return self.device.startswith("cuda")

    def receive(self, metas: Sequence[TensorMeta], payload: Any) -> list[tuple[str, torch.Tensor]]:
        if self._cuda() and torch.device(self.device).index is not None:
            torch.cuda.set_device(torch.device(self.device))
        if self.method == "broadcast":
            flat = torch.empty(int(payload), dtype=torch.uint8, device=_buffer_device(self.backend, self.device))
            broadcast(self.pg, flat)
        else:
            flat = open_ipc(payload, self.device)
        self._held = flat
        return unpack_bucket(flat, metas)

    def done(self) -> None:
        """After the engine copied the bucket: wait for the copies, release the buffer (IPC: the
        sender may free it once we answer)."""
        if self._cuda():
            torch.cuda.synchronize(torch.device(self.device))
        self._held = None


# ----------------------------------------------------------------------------- driver side


def connect(choice: SyncChoice, policy: Sequence[Any], policy_ips: Sequence[str], engines: Sequence[Any],
            engine_ips: Sequence[str], wait: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Set up `choice` on the actors: every policy rank gets its `SenderPlan`, every engine its
    receiver (broadcast: all members form the group at once and check it with one byte).
    `wait(refs, who)` waits for remote calls (`who`: "policy" / "engine" index pairs)."""
    if choice.method == "object_store":
        return
    group = None
    if choice.method == "broadcast":
        [port] = wait([policy[0].reserve_port.remote()], [("policy", 0)])
        local = len({*policy_ips[:1], *engine_ips}) == 1
        group = GroupSpec("127.0.0.1" if local else policy_ips[0], port, 1 + len(engines), choice.backend or "gloo",
                          local=local, timeout_s=timeout_s)
        targets = {0: dict(enumerate(engines))}
    else:
        targets = {}
        for i, r in enumerate(choice.ipc_source):
            targets.setdefault(r, {})[i] = engines[i]
    refs, who = [], []
    for r, actor in enumerate(policy):
        plan = SenderPlan(choice.method, targets.get(r, {}), group if r == 0 else None, timeout_s)
        refs.append(actor.init_weight_sync.remote(plan))
        who.append(("policy", r))
    for i, e in enumerate(engines):
        refs.append(e.init_weight_sync.remote(choice.method, group, 1 + i))
        who.append(("engine", i))
    wait(refs, who)
