"""Sleep for training states: device storages -> host buffers allocated once -> back, bit for bit.

    stash = HostStash(device)
    stash.offload(named, drop=named_rebuildable)       stash.reload(rebuild=fn)
      unique storages of `named` (a view and its           resize every storage back (device allocation)
        base move once, as whole storages)                 side stream waits for the compute stream
      side stream waits for the compute stream             side stream: host slot -> device, non-blocking
      side stream: device -> host slot, non-blocking       the compute stream waits for the side stream,
      one sync; each storage resized to 0 (freed);           then `rebuild()` (e.g. masters -> bf16 params)
        `drop` storages are freed without a copy           one sync
      empty_cache(), so another process can use the GPU

Why storages: a tensor keeps its identity (the optimizer's parameters, FSDP2's DTensor shards and
the padded flat buffer their local tensors view, the optimizer's state dict) and only its memory
leaves the device, so nothing has to be re-registered and an FSDP2 shard's padding comes back too.
`UntypedStorage.resize_` is what FSDP2 itself uses to free unsharded parameters.

Host slots are keyed by the tensor's name (`param:model.norm.weight`, `opt:...:exp_avg`), so they
are found again at the next offload although the device addresses changed. A slot is allocated the
first time its name is seen, or reserved before that (the optimizer's states appear after the first
step; the backend reserves theirs at the first offload), and reused for every later offload; names
that disappear keep their slots (a bounded set: the model's tensors).
Slots of one offload are carved out of one host buffer. With CUDA the buffer is page-locked with
`cudaHostRegister`, which pins exactly the requested size (torch's pinned allocator rounds each
allocation up to a power of two, up to 2x the states), so copies are DMA transfers that do not
block the host thread. Without CUDA nothing is pinned and the same code runs (tests exercise it on
CPU); storages that cannot be resized (on CPU: weights memory-mapped from the checkpoint) are left
where they are.

`offload` / `reload` return `MoveStats` (seconds, bytes copied), also kept as `last_offload` /
`last_reload` for the RL loop's `time/offload`, `time/reload` and `offload_gb`.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

log = logging.getLogger(__name__)

ALIGN = 512  # bytes; slot starts inside a host buffer
Named = Iterable[tuple[str, "torch.Tensor | None"]]


@dataclass(frozen=True)
class MoveStats:
    """One offload or reload: wall seconds (including the final sync), bytes copied, and where the
    seconds went (`parts`: "copy" = launching the copies + the sync, "free" = resizing storages
    (reload: allocating them) + empty_cache, "rebuild")."""

    seconds: float = 0.0
    nbytes: int = 0
    parts: dict[str, float] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, float]:
        return {"seconds": self.seconds, "bytes": float(self.nbytes)}


@dataclass
class _Moved:
    key: str
    storage: torch.UntypedStorage
    nbytes: int
    freed: bool  # resized to 0 (False: a storage that cannot be resized, left in place)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _as_bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown
        pass


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory, page-locked (exact size, cudaHostRegister) when `pin`."""
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    if pin:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of %.2f GiB failed (error %s); offload copies will be pageable",
                        nbytes / 2**30, err)
        else:
            weakref.finalize(buf, _unregister, buf.data_ptr())
    return buf


class HostStash:
    """Host copies of a set of device tensors' storages; see the module docstring."""

    def __init__(self, device: torch.device | str, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin = (self.device.type == "cuda") if pin is None else pin
        self.offloaded = False
        self.last_offload = MoveStats()
        self.last_reload = MoveStats()
        self.buffers: list[torch.Tensor] = []  # host buffers, each carved into slots
        self._slots: dict[str, torch.Tensor] = {}
        self._moved: list[_Moved] = []
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self._stream = None

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def slot(self, key: str) -> torch.Tensor | None:
        return self._slots.get(key)

    # ------------------------------------------------------------------ helpers

    def _unique(self, named: Named, seen: set[int]) -> list[tuple[str, torch.UntypedStorage, int]]:
        out = []
        with torch.no_grad():
            for key, t in named:
                if t is None:
                    continue
                local = _local(t)
                if local.device != self.device:
                    continue
                s = local.untyped_storage()
                n = s.nbytes()
                if n == 0 or s.data_ptr() in seen:
                    continue
                seen.add(s.data_ptr())
                out.append((key, s, n))
        return out

    def _ensure_slots(self, sizes: list[tuple[str, int]]) -> None:
        """One new host buffer carved into the slots of the keys that have none (or one of another size)."""
        missing = [(k, n) for k, n in dict(sizes).items() if k not in self._slots or self._slots[k].numel() != n]
        if not missing:
            return
        offsets, total = [], 0
        for _, n in missing:
            offsets.append(total)
            total += -(-n // ALIGN) * ALIGN
        buf = host_buffer(total, self.pin)
        self.buffers.append(buf)
        for (k, n), off in zip(missing, offsets):
            self._slots[k] = buf[off:off + n]

    def _side_stream(self):
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for each pair, on the side stream (CUDA) with one sync at the end."""
        stream = self._side_stream()
        if stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        stream.synchronize()

    # ------------------------------------------------------------------ offload / reload

    def offload(self, named: Named, drop: Named = (), reserve: Iterable[tuple[str, int]] = ()) -> MoveStats:
        """Copy the storages of `named` to their host slots and free them on the device; free the
        storages of `drop` without a copy (the caller rebuilds them in `reload(rebuild=...)`).
        `reserve`: (key, bytes) of tensors that do not exist yet but will at a later offload (an
        optimizer's states before its first step): their slots come out of this offload's buffer,
        so the later offload allocates and pins nothing."""
        if self.offloaded:
            raise RuntimeError("HostStash.offload: already offloaded (reload first)")
        t0 = time.perf_counter()
        seen: set[int] = set()
        entries = self._unique(named, seen)
        dropped = [(s, n) for _, s, n in self._unique(drop, seen) if s.resizable()]
        self._ensure_slots([(k, n) for k, _, n in entries] + [(k, n) for k, n in reserve if k not in self._slots])
        t1 = time.perf_counter()
        self._copy([(self._slots[k], _as_bytes(s, n)) for k, s, n in entries])
        t2 = time.perf_counter()
        self._moved = []
        for k, s, n in entries:
            freed = s.resizable()
            if freed:
                s.resize_(0)
            self._moved.append(_Moved(k, s, n, freed))
        for s, _ in dropped:
            s.resize_(0)
        self._dropped = dropped
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.offloaded = True
        t3 = time.perf_counter()
        self.last_offload = MoveStats(t3 - t0, sum(n for _, _, n in entries),
                                      {"slots": t1 - t0, "copy": t2 - t1, "free": t3 - t2})
        return self.last_offload

    def reload(self, rebuild: Callable[[], None] | None = None) -> MoveStats:
        """Reallocate and refill every storage of the last offload, then `rebuild()` the dropped ones."""
        if not self.offloaded:
            return MoveStats()
        t0 = time.perf_counter()
        for m in self._moved:
            if m.freed:
                m.storage.resize_(m.nbytes)
        for s, n in self._dropped:
            s.resize_(n)
        t1 = time.perf_counter()
        stream = self._side_stream()
        pairs = [(_as_bytes(m.storage, m.nbytes), self._slots[m.key]) for m in self._moved]
        if stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            if rebuild is not None:
                rebuild()
        else:
            with torch.cuda.stream(stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if rebuild is not None:
                rebuild()
            torch.cuda.current_stream(self.device).synchronize()
        nbytes = sum(m.nbytes for m in self._moved)
        self._moved, self._dropped = [], []
        self.offloaded = False
        t2 = time.perf_counter()
        self.last_reload = MoveStats(t2 - t0, nbytes, {"alloc": t1 - t0, "copy_rebuild": t2 - t1})
        return self.last_reload
