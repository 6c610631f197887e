"""Weight buckets: the one grouping of (name, tensor) streams by size, and the flat byte layout.

`iter_buckets(named, bucket_bytes, cast)` is the only place weights are grouped for a sync: every
transport and the router's object-store path call it with the `--weight_sync_bucket_mb` size
(`DEFAULT_BUCKET_MB` when none is given).

Bucket layout (`pack_bucket` / `unpack_bucket`): one uint8 tensor; tensor k's bytes start at
`TensorMeta.offset`, aligned to `ALIGN` bytes so every dtype view is aligned; a name whose tensor
aliases an earlier one (tied embeddings) points at the same bytes and costs nothing. The metadata
(name, shape, dtype, offset, nbytes) travels through Ray; the bytes go through the transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from rlhfkit.config.dtypes import TORCH_DTYPES
from rlhfkit.weightsync.flags import DEFAULT_BUCKET_MB

__all__ = ["ALIGN", "DEFAULT_BUCKET_MB", "TensorMeta", "iter_buckets", "pack_bucket", "unpack_bucket"]
ALIGN = 64  # bytes; >= every dtype's element size, and a cache-line multiple

Named = tuple[str, torch.Tensor]


@dataclass(frozen=True)
class TensorMeta:
    """Where one named tensor lies in a flat bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    offset: int  # bytes
    nbytes: int


def _dtype(name: str) -> torch.dtype:
    dt = TORCH_DTYPES.get(name)
    if dt is None:
        raise ValueError(f"weight sync metadata names an unknown dtype {name!r}")
    return dt


def target_dtype(t: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    """The dtype `t` is sent in: `cast` for floating tensors (when given), else its own."""
    return cast if cast is not None and t.is_floating_point() else t.dtype


def sent_nbytes(t: torch.Tensor, cast: torch.dtype | None) -> int:
    return t.numel() * target_dtype(t, cast).itemsize


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def iter_buckets(named: Iterable[Named], bucket_bytes: int,
                 cast: torch.dtype | None = None) -> Iterator[list[Named]]:
    """Consecutive lists of (name, tensor) whose sizes (after the cast, each rounded up to `ALIGN`)
    sum to at most `bucket_bytes`; a larger tensor goes alone. Order is kept and every pair appears
    once. Consumes `named` to the end, which FSDP2's gathering needs on every rank."""
    if bucket_bytes <= 0:
        raise ValueError(f"--weight_sync_bucket_mb must be > 0 (got {bucket_bytes} bytes)")
    bucket: list[Named] = []
    size = 0
    for name, t in named:
        n = _round_up(sent_nbytes(t, cast))
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def pack_bucket(named: Sequence[Named], device: torch.device | str = "cpu",
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
        dt = target_dtype(t, cast)
        meta = TensorMeta(name, tuple(t.shape), str(dt).removeprefix("torch."), size, sent_nbytes(t, cast))
        seen[key] = meta
        metas.append(meta)
        sources.append((t, meta))
        size = _round_up(size + meta.nbytes)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    for t, meta in sources:
        if meta.nbytes:
            src = t.to(dtype=_dtype(meta.dtype)).contiguous().reshape(-1).view(torch.uint8)
            flat[meta.offset:meta.offset + meta.nbytes].copy_(src)
    return flat, metas


def unpack_bucket(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[Named]:
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
