"""CPU-visible parts of the builtin engine's GPU kernels: launch heuristics, the decode-attention
choice, and the merge of the Triton sampler's per-chunk results (checked against a direct
log-sum-exp / argmax over the whole row)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.rollout.builtin import BuiltinEngineConfig
from rlhfkit.rollout.builtin.kernels.triton_attention import attention_launch, attention_splits, attention_supported
from rlhfkit.rollout.builtin.loop.sampling import (combine_partials, hierarchical_gumbel_argmax, reference_partials,
                                                   sample_tokens)
from rlhfkit.rollout.builtin.model.decoder import resolve_decode_attention
from rlhfkit.rollout.builtin.model.spec import ModelSpec


def test_attention_splits_fill_two_waves_of_long_contexts_only():
    # 132 SMs: 264 programs wanted; 3 rows x 2 KV heads = 6 programs -> 44, capped by 1500 // 512 = 2
    assert attention_splits(3, 2, 1500, 132) == 2
    assert attention_splits(2, 4, 4096, 132) == 8  # 8 programs -> 33, 4096 // 512 = 8
    assert attention_splits(1, 1, 32768, 132) == 16  # capped at 16
    assert attention_splits(256, 2, 4096, 132) == 1  # 512 programs already fill two waves
    assert attention_splits(4, 2, 384, 132) == 1  # short context: one split


def test_attention_launch_parameters():
    assert attention_launch(256, 2, 64, 384, 132) == {"block_n": 64, "num_warps": 4, "num_stages": 2, "splits": 1}
    assert attention_launch(64, 2, 64, 384, 132) == {"block_n": 128, "num_warps": 4, "num_stages": 3, "splits": 1}
    assert attention_launch(64, 2, 128, 1536, 132)["block_n"] == 64  # wide heads: smaller tiles


def test_attention_supported_shapes():
    assert attention_supported(14, 2, 64) and attention_supported(32, 8, 128)
    assert not attention_supported(14, 2, 80)  # not a power of two
    assert attention_supported(4, 1, 256) and not attention_supported(16, 16, 512)  # 512: tiles too large
    assert not attention_supported(14, 4, 64)  # heads not a multiple of KV heads


def _spec(head_dim: int = 16) -> ModelSpec:
    return ModelSpec("qwen2", 100, 4 * head_dim, 1, 4, 2, head_dim, 8, 1e-6, False, True, 512)


def test_decode_attention_choice_on_cpu():
    assert resolve_decode_attention("auto", _spec(), torch.device("cpu")) == "sdpa"
    assert resolve_decode_attention("matmul", _spec(), torch.device("cpu")) == "matmul"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_decode_attention("triton", _spec(), torch.device("cpu"))
    with pytest.raises(ValueError, match="decode_attention"):
        BuiltinEngineConfig(decode_attention="flash").validate()


def test_partials_by_hand():
    """One row of 5 scores, chunks of 2, T = 0.5, token 1 banned: the kernel's per-chunk outputs."""
    logits = torch.tensor([[0.0, 1.0, 0.5, -1.0, 2.0]])
    best, idx, m, s, kept = reference_partials(logits, torch.tensor([0.5]), torch.tensor([[1]]),
                                               torch.tensor([[True]]), chunk=2)
    assert best.tolist() == [[0.0, 1.0, 4.0]] and idx.tolist() == [[0, 2, 4]]  # banned 1 never best
    assert m.tolist() == [[2.0, 1.0, 4.0]]
    e = math.exp
    assert torch.allclose(s, torch.tensor([[e(-2.0) + 1.0, 1.0 + e(-3.0), 1.0]]))
    assert torch.allclose(kept, torch.tensor([[e(-2.0), 1.0 + e(-3.0), 1.0]]))  # chunk 0 without token 1


def test_combine_partials_equals_the_torch_sampler():
    """The GPU path (per-chunk partials -> combine_partials) draws the tokens of the torch path
    (hierarchical Gumbel-max with the same chunks and noise) and reports log_softmax(z / T)."""
    torch.manual_seed(0)
    rows, vocab, chunk = 64, 50, 8  # 7 chunks, the last one partial
    logits = torch.randn(rows, vocab) * 3
    temp = torch.rand(rows) + 0.3
    temp[:8] = 0.0
    seeds, counters = torch.randint(0, 2**62, (rows,)), torch.randint(0, 100, (rows,))
    stop = torch.randint(0, vocab, (rows, 3))
    ban = torch.rand(rows, 3) < 0.5
    stop[:4, 0], ban[:4, 0] = logits[:4].argmax(1), True  # ban the greedy choice of 4 greedy rows
    parts = reference_partials(logits, temp, stop, ban, chunk=chunk)
    tok, lp = combine_partials(logits, temp, seeds, counters, stop, ban, *parts, chunk=chunk)
    t = torch.where(temp > 0, temp, torch.ones_like(temp))
    banned = torch.zeros(rows, vocab, dtype=torch.bool)
    banned.scatter_(1, stop, ban)
    masked = (logits / t[:, None]).masked_fill(banned, float("-inf"))
    ref = hierarchical_gumbel_argmax(masked, seeds, counters, chunk=chunk)
    assert torch.equal(tok[8:], ref[8:])
    assert torch.equal(tok[:8], masked[:8].argmax(1)) and not banned.gather(1, tok[:, None]).any()
    expected = torch.log_softmax(logits / t[:, None], -1).gather(1, tok[:, None]).squeeze(1)
    assert torch.allclose(lp, expected, atol=1e-5)


def test_fast_sampler_flag_is_ignored_on_cpu():
    logits = torch.randn(4, 50)
    args = (logits, torch.ones(4), torch.ones(4), torch.full((4,), 50), torch.zeros(4, 1, dtype=torch.long),
            torch.zeros(4, 1, dtype=torch.bool), torch.arange(4), torch.zeros(4, dtype=torch.long), False)
    fast, slow = sample_tokens(*args, fast=True), sample_tokens(*args, fast=False)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
