"""Pretraining batches for PPO-ptx (`--pretrain_data`, `--ptx_coef`).

The items (tokenized text, loss on every token: `SFTDataset` in pretrain mode) are read as an
endless stream: epoch e is a permutation of the items seeded by (seed, e). Global micro-batch g
holds stream rows [g * B * W, (g + 1) * B * W) (B = micro-batch size, W = data-parallel ranks),
and rank r takes its B consecutive rows. The policy asks for micro-batch
`steps_done * micro_per_step + i` for the i-th micro-batch of an optimizer step, so the batches
are a function of the step number: a resumed run draws the ones the uninterrupted run would.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rlhfkit.data.collate import PaddedBatch, pad_batch


class PtxBatches:
    """This rank's padded pretraining micro-batches, by global micro-batch index."""

    def __init__(self, items: Sequence[Any], micro_batch_size: int, pad_token_id: int, rank: int = 0,
                 world_size: int = 1, seed: int = 42) -> None:
        if not items:
            raise ValueError("--pretrain_data has no usable samples")
        self.items = list(items)
        self.micro_batch_size, self.pad_token_id = micro_batch_size, pad_token_id
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7 * epoch + 1)
            self._orders = {epoch: torch.randperm(len(self.items), generator=g).tolist()}
        return self._orders[epoch]

    def row(self, j: int) -> Any:
        """Item at position `j` of the endless stream."""
        n = len(self.items)
        return self.items[self._order(j // n)[j % n]]

    def indices(self, g: int) -> list[int]:
        """Stream positions of this rank's rows of global micro-batch `g`."""
        b = self.micro_batch_size
        start = (g * self.world_size + self.rank) * b
        return list(range(start, start + b))

    def batch(self, g: int) -> PaddedBatch:
        return pad_batch([self.row(j) for j in self.indices(g)], self.pad_token_id)
