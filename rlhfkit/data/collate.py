"""Collation: padded `[B, L]` batches, packed `[1, T]` rows, and token-budget micro-batches.

    items (input_ids, loss_mask lists)
      |-- pad_batch  -> PaddedBatch  input_ids / attention_mask / loss_mask  [B, L], right padded
      `-- pack_batch -> PackedBatch  input_ids / position_ids / loss_mask    [1, T], seq_lens [B]
                                     (positions restart at 0 for every sample)

Both batch records can also be read like dicts (`batch["input_ids"]`). `split_by_token_budget`
groups sample indices into micro-batches of at most `max_tokens` tokens (OpenRLHF's
`--max_tokens_per_gpu` dynamic batching), greedily in order or balanced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

import torch


def _field(item: Any, name: str) -> Any:
    return item[name] if isinstance(item, Mapping) else getattr(item, name)


def pad_sequences(seqs: Sequence[Sequence[int] | Sequence[float]], value: float = 0, side: str = "right",
                  dtype: torch.dtype = torch.long, length: int | None = None) -> torch.Tensor:
    """Stack lists of different lengths into `[B, max(L, length)]`, filling with `value`."""
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    width = max([len(s) for s in seqs] + [length or 0])
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            row = torch.as_tensor(list(s), dtype=dtype)
            if side == "right":
                out[i, : len(s)] = row
            else:
                out[i, width - len(s):] = row
    return out


class _DictLike:
    """`batch["name"]` reads the field `name`; `.to(device)` moves every tensor."""

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]  # type: ignore[arg-type]

    def to(self, device: torch.device | str) -> Any:
        kw = {f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
              for f in fields(self) for v in (getattr(self, f.name),)}  # type: ignore[arg-type]
        out = type(self)(**kw)
        if hasattr(self, "loss_mask"):  # counted here, on the host: reading it on a GPU would be a sync
            out._loss_tokens = (out.loss_mask, self.num_loss_tokens)
        mask = getattr(self, "attention_mask", None)
        if isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and out.attention_mask is not mask \
                and bool(mask.all()):
            mark_no_padding(out.attention_mask)
        return out

    @property
    def num_loss_tokens(self) -> int:
        cached = self.__dict__.get("_loss_tokens")
        mask = self.loss_mask  # type: ignore[attr-defined]
        if cached is not None and cached[0] is mask:
            return cached[1]
        return int(mask.sum())


def mark_no_padding(attention_mask: torch.Tensor) -> None:
    """Note on a device mask that it holds no padding (known on the host before the copy), so that the
    forward need not ask the GPU (`models.forward.forward_kwargs`)."""
    attention_mask._rlhfkit_no_padding = True  # type: ignore[attr-defined]


@dataclass
class PaddedBatch(_DictLike):
    """Right-padded batch: `input_ids`, `attention_mask`, `loss_mask`, all `[B, L]` long; `images`
    (a VLM's rows): each row's processed pictures (`ImageInputs`) or None, left on the host."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    images: list[Any] | None = None

    def masks(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(attention_mask, position_ids) for the model: a padded batch has a mask, no positions."""
        return self.attention_mask, None


@dataclass
class PackedBatch(_DictLike):
    """Samples concatenated into one row: `input_ids`, `position_ids`, `loss_mask` `[1, T]`.

    `seq_lens[i]` is the length of sample i; `position_ids` restart at 0 at every sample start.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    seq_lens: list[int]

    def masks(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(attention_mask, position_ids) for the model: a packed row has positions, no mask."""
        return None, self.position_ids

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token tensor `[1, T, ...]` or `[T, ...]` into one tensor per sample."""
        return unpack(values, self.seq_lens)

    def to_padded(self, values: torch.Tensor, value: float = 0) -> torch.Tensor:
        """A per-token tensor `[1, T]` as a right-padded `[B, max(seq_lens)]`."""
        parts = self.unpack(values)
        out = values.new_full((len(parts), max(self.seq_lens)), value)
        for i, p in enumerate(parts):
            out[i, : len(p)] = p
        return out


def pad_batch(items: Sequence[Any], pad_id: int, side: str = "right",
              pictures: Callable[[Sequence[Any]], Any] | None = None) -> PaddedBatch:
    """Items with `input_ids` and `loss_mask` (lists) -> `PaddedBatch` `[B, L]`. `pictures` turns an
    item's `images` (refs) into its row's `ImageInputs` (a VLM's data)."""
    ids = [_field(it, "input_ids") for it in items]
    images = None
    if pictures is not None and any(getattr(it, "images", None) for it in items):
        if side != "right":
            raise ValueError("pad_batch: rows with pictures are right padded")
        images = [pictures(it.images) if it.images else None for it in items]
    return PaddedBatch(
        input_ids=pad_sequences(ids, pad_id, side),
        attention_mask=pad_sequences([[1] * len(s) for s in ids], 0, side),
        loss_mask=pad_sequences([_field(it, "loss_mask") for it in items], 0, side),
        images=images,
    )


def pack_batch(items: Sequence[Any]) -> PackedBatch:
    """Items with `input_ids` and `loss_mask` -> one packed row `[1, T]`, T = sum of lengths."""
    ids = [list(_field(it, "input_ids")) for it in items]
    if any(len(s) == 0 for s in ids):
        raise ValueError("pack_batch: empty sample")
    seq_lens = [len(s) for s in ids]
    flat = [t for s in ids for t in s]
    positions = [p for n in seq_lens for p in range(n)]
    mask = [m for it in items for m in _field(it, "loss_mask")]
    if len(mask) != len(flat):
        raise ValueError("pack_batch: loss_mask and input_ids lengths differ")
    as_row = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(0)  # noqa: E731
    return PackedBatch(as_row(flat), as_row(positions), as_row(mask), seq_lens)


def unpack(values: torch.Tensor, seq_lens: Sequence[int]) -> list[torch.Tensor]:
    """Split `[1, T, ...]` or `[T, ...]` along T into pieces of `seq_lens`."""
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == sum(seq_lens):
        values = values[0]
    if values.shape[0] != sum(seq_lens):
        raise ValueError(f"unpack: {values.shape[0]} tokens but seq_lens sum to {sum(seq_lens)}")
    return list(torch.split(values, list(seq_lens), dim=0))


# ----------------------------------------------------------------------------- token budgets


def split_by_token_budget(lengths: Sequence[int], max_tokens: int, balanced: bool = False,
                          min_bins: int = 1) -> list[list[int]]:
    """Group sample indices into micro-batches of at most `max_tokens` tokens each.

    greedy (default): walk the samples in order and start a new micro-batch when the next one
    would overflow -- micro-batches are runs of consecutive indices.
    balanced: the fewest bins (at least `min_bins`, e.g. the maximum over ranks so every rank
    runs the same number of micro-batches) found by longest-first assignment to the lightest bin
    that fits (LPT, longest processing time first), so token counts are even across bins.
    A sample longer than `max_tokens` gets a bin of its own. Indices inside a bin are ascending
    and bins are ordered by their first index, so the result is deterministic.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if min_bins > max(len(lengths), 1):
        raise ValueError(f"cannot split {len(lengths)} samples into {min_bins} non-empty micro-batches")
    if not lengths:
        return []
    if balanced or min_bins > 1:
        return _balanced_bins(lengths, max_tokens, min_bins)
    bins: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(lengths):
        if bins[-1] and total + n > max_tokens:
            bins.append([])
            total = 0
        bins[-1].append(i)
        total += n
    return bins


def _balanced_bins(lengths: Sequence[int], max_tokens: int, min_bins: int) -> list[list[int]]:
    # lower bound on the bin count; clipped lengths keep it <= len(lengths), where LPT always succeeds
    k = max(min_bins, math.ceil(sum(min(n, max_tokens) for n in lengths) / max_tokens))
    while True:
        bins = _lpt(lengths, max_tokens, k)
        if bins is not None:
            return sorted((sorted(b) for b in bins), key=lambda b: b[0])
        k += 1


def _lpt(lengths: Sequence[int], max_tokens: int, k: int) -> list[list[int]] | None:
    """Longest first into the lightest bin that fits; None when some sample fits nowhere."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    oversize = [i for i in order if lengths[i] > max_tokens]
    if len(oversize) > k:
        return None
    bins: list[list[int]] = [[i] for i in oversize] + [[] for _ in range(k - len(oversize))]
    loads = [lengths[i] for i in oversize] + [0] * (k - len(oversize))
    for i in order:
        if lengths[i] > max_tokens:
            continue
        fits = [b for b in range(len(oversize), k) if loads[b] + lengths[i] <= max_tokens]
        if not fits:
            return None
        b = min(fits, key=lambda j: (loads[j], j))
        bins[b].append(i)
        loads[b] += lengths[i]
    if any(not b for b in bins):
        return None
    return bins
