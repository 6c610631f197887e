"""How context parallelism packs, splits and restores a batch (parallel/context_parallel.py), in one process.

`_Plan` needs only the ring's rank and size, so each rank of a ring of 2 is played in turn here; the
ring attention itself and the gathers are checked under torchrun (tests/distributed/test_context_parallel.py).
Expected values are written out by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhfkit.parallel.context_parallel import _Plan, check_cp, check_cp_model, next_token_targets
from rlhfkit.parallel.mesh import ParallelDims
from rlhfkit.parallel.ring_attention import unsplit_ring


def plans(input_ids, attention_mask=None, position_ids=None, world=2):
    return [_Plan(SimpleNamespace(rank=r, world=world, group=None, head_stride=None), input_ids, attention_mask,
                  position_ids) for r in range(world)]


def test_padded_rows_lose_their_padding_and_keep_their_positions():
    ids = torch.tensor([[0, 0, 11, 12, 13],    # left-padded, 3 tokens
                        [21, 22, 23, 24, 0]])  # right-padded, 4 tokens
    mask = (ids != 0).long()
    p0, p1 = plans(ids, mask)
    assert p0.flat_ids.tolist() == [[11, 12, 13, 21, 22, 23, 24]]
    assert p0.cu.tolist() == [0, 3, 7]
    # 7 tokens padded to 8 = 2 x 2 chunks of 2; zig-zag: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert p0.local_ids.tolist() == [[11, 12, 24, 0]] and p1.local_ids.tolist() == [[13, 21, 22, 23]]
    # positions count real tokens from each row's first (cumsum(mask) - 1), whatever the padding side
    assert p0.local_pos.tolist() == [[0, 1, 3, 0]] and p1.local_pos.tolist() == [[2, 0, 1, 2]]
    flat = torch.arange(1.0, 8.0)[None]
    assert p0.to_batch(flat).tolist() == [[0, 0, 1, 2, 3], [4, 5, 6, 7, 0]]


def test_packed_rows_and_unmasked_rows_split_at_sequence_starts():
    ids = torch.arange(10, 19)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    p0, _ = plans(ids, position_ids=pos)
    assert p0.cu.tolist() == [0, 3, 5, 9] and p0.total == 9
    # no mask, no positions: every row is one sequence
    p0, _ = plans(torch.ones(3, 4, dtype=torch.long))
    assert p0.cu.tolist() == [0, 4, 8, 12]
    assert p0.to_batch(torch.arange(12.0)[None]).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_targets_are_shifted_on_the_full_row_before_the_split():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    p0, p1 = plans(ids)
    t0, t1 = next_token_targets(p0), next_token_targets(p1)
    # rank 0 holds tokens 5 6 | 11 12: token 6 is followed by 7, which lives on rank 1
    assert t0.tolist() == [6, 7, 12, 5] and t1.tolist() == [8, 9, 10, 11]
    full = unsplit_ring([t0[None], t1[None]], dim=1, length=8)
    assert full.tolist() == [[6, 7, 8, 9, 10, 11, 12, 5]]  # the last (wrapped) target is never used


def test_empty_batch_still_has_a_part_on_every_rank():
    p0, p1 = plans(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    assert p0.total == 0 and p0.cu.tolist() == [0, 0]
    assert p0.local_ids.shape == p1.local_ids.shape == (1, 2)
    assert p0.to_batch(torch.zeros(1, 0)).tolist() == [[0, 0, 0]]


def test_model_checks_name_the_flags(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # 4 key/value heads
    check_cp_model(model, 2)
    with pytest.raises(ValueError, match="--ring_head_stride 3 must divide the model's key/value heads \\(4\\)"):
        check_cp_model(model, 3)
    with pytest.raises(ValueError, match="--ring_attn_size: model type None is not supported"):
        check_cp_model(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="--ring_attn_size 2 needs a process group"):
        check_cp(model, ParallelDims(dp_shard=1, cp=2, world_size=2), 1, has_process_group=False)
    check_cp(torch.nn.Linear(2, 2), ParallelDims(), 1, has_process_group=False)  # cp 1: nothing to check
