"""Where each token of a sequence lives under ring attention (ring_attention.py): the zig-zag or
contiguous split of a row over the ranks of a group, each local token's global position, the gather
that puts the full row back, and packed position ids -> cu_seqlens."""

from __future__ import annotations

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


def _num_chunks(world: int, layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"ring attention layout must be one of {LAYOUTS}, got {layout!r}")
    return 2 * world if layout == "zigzag" else world


def padded_length(length: int, world: int, layout: str = "zigzag") -> int:
    """The length `split_for_ring` pads a sequence of `length` to (a multiple of 2N, or N)."""
    n = _num_chunks(world, layout)
    return -(-length // n) * n


def ring_positions(local_len: int, rank: int, world: int, layout: str = "zigzag",
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (in the padded full row) of the `local_len` tokens rank `rank` holds: [local_len]."""
    if layout == "contiguous":
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)
    _num_chunks(world, layout)
    if local_len % 2:
        raise ValueError(f"a zig-zag ring chunk has an even length (two halves), got {local_len}")
    c = local_len // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c, device=device)
    return torch.cat([first, second])


def split_for_ring(x: torch.Tensor, rank: int, world: int, dim: int = 1, layout: str = "zigzag",
                   pad_value: float = 0) -> torch.Tensor:
    """This rank's part of the full tensor `x` along `dim`, after right-padding that dim with `pad_value`
    to `padded_length`. Differentiable (slicing); the inverse is `unsplit_ring` / `gather_from_ring`."""
    if not 0 <= rank < world:
        raise ValueError(f"ring rank {rank} is outside a ring of {world}")
    dim = dim % x.dim()
    length = x.shape[dim]
    full = padded_length(length, world, layout)
    if full != length:
        shape = list(x.shape)
        shape[dim] = full - length
        x = torch.cat([x, x.new_full(shape, pad_value)], dim=dim)
    if layout == "contiguous":
        return x.narrow(dim, rank * (full // world), full // world)
    c = full // (2 * world)
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * world - 1 - rank) * c, c)], dim=dim)


def unsplit_ring(chunks: list[torch.Tensor], dim: int = 1, layout: str = "zigzag",
                 length: int | None = None) -> torch.Tensor:
    """The full tensor from every rank's part (`chunks[i]` from rank i), cut back to `length`."""
    world = len(chunks)
    _num_chunks(world, layout)
    dim = dim % chunks[0].dim()
    if layout == "contiguous":
        full = torch.cat(chunks, dim=dim)
    else:
        c = chunks[0].shape[dim] // 2
        firsts = [ch.narrow(dim, 0, c) for ch in chunks]
        seconds = [ch.narrow(dim, c, c) for ch in reversed(chunks)]
        full = torch.cat(firsts + seconds, dim=dim)
    return full if length is None else full.narrow(dim, 0, length)


def gather_from_ring(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1,
                     layout: str = "zigzag", length: int | None = None) -> torch.Tensor:
    """All-gather every rank's part of `x` over `group` and return the full tensor (not differentiable)."""
    world = _world(group)
    if world == 1:
        return unsplit_ring([x], dim, layout, length)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unsplit_ring(parts, dim, layout, length)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed position ids [T] (or [1, T]) restarting at 0 for each sequence -> cu_seqlens [n + 1] (int32)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() == 0 or starts[0] != 0:
        raise ValueError("packed position_ids must start each sequence at 0, the first one included")
    end = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def _world(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("ring attention was given a process group but torch.distributed is not initialised")
        return 1
    return dist.get_world_size(group)
