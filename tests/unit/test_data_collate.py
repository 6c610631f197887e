"""Padding, packing and token-budget micro-batches."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.data.collate import pack_batch, pad_batch, pad_sequences, split_by_token_budget, unpack
from rlhfkit.data.items import SFTItem

ITEMS = [SFTItem([5, 6, 7], [0, 1, 1]), SFTItem([8], [0]), SFTItem([9, 10], [0, 1])]


def test_pad_batch_right_padded():
    b = pad_batch(ITEMS, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1], [0, 0, 0], [0, 1, 0]]
    assert b["input_ids"] is b.input_ids and b.num_loss_tokens == 3
    dict_items = [{"input_ids": it.input_ids, "loss_mask": it.loss_mask} for it in ITEMS]
    assert torch.equal(pad_batch(dict_items, 0).input_ids, b.input_ids)
    assert pad_sequences([[1], [2, 3]], value=-1, side="left").tolist() == [[-1, 1], [2, 3]]


def test_pack_batch_positions_restart():
    p = pack_batch(ITEMS)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert p.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert p.seq_lens == [3, 1, 2]
    assert [t.tolist() for t in p.unpack(p.input_ids)] == [[5, 6, 7], [8], [9, 10]]
    assert torch.equal(p.to_padded(p.input_ids), pad_batch(ITEMS, 0).input_ids)
    with pytest.raises(ValueError, match="seq_lens sum to 6"):
        unpack(torch.zeros(5), [3, 1, 2])


def test_greedy_token_budget_keeps_order():
    lengths = [4, 3, 5, 2, 9, 1]
    # budget 8: [4,3] (7), [5,2] (7), [9] alone (over budget), [1]
    assert split_by_token_budget(lengths, 8) == [[0, 1], [2, 3], [4], [5]]
    assert split_by_token_budget([], 8) == []


def test_balanced_token_budget():
    lengths = [7, 1, 1, 1, 6, 2, 5, 3]  # 26 tokens, budget 10 -> 3 bins
    bins = split_by_token_budget(lengths, 10, balanced=True)
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(bins) == 3 and max(loads) <= 10 and loads[-1] - loads[0] <= 1
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(b == sorted(b) for b in bins) and [b[0] for b in bins] == sorted(b[0] for b in bins)
    assert split_by_token_budget(lengths, 10, balanced=True) == bins  # deterministic
    # at least 5 bins (e.g. the most any rank needs)
    assert len(split_by_token_budget(lengths, 10, min_bins=5)) == 5
    # a sample over budget gets its own bin
    over = split_by_token_budget([20, 1, 1], 10, balanced=True)
    assert [0] in over and sorted(i for b in over for i in b) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot split 3 samples into 4"):
        split_by_token_budget([1, 1, 1], 10, min_bins=4)
