"""CPU-visible parts of the builtin engine's GPU kernels: launch heuristics, the decode-attention
choice, and the merge of the Triton sampler's per-chunk results (checked against a direct
log-sum-exp / argmax over the whole row)."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rollout.builtin import BuiltinEngineConfig
from rlhfkit.rollout.builtin.engine import resolve_decode_attention
from rlhfkit.rollout.builtin.sampling import combine_partials, sample_tokens
from rlhfkit.rollout.builtin.triton_ops import attention_launch, attention_splits, attention_supported
from rlhfkit.rollout.builtin.weights import ModelSpec


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
    assert not attention_supported(16, 16, 256)  # tiles too large for shared memory
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


def test_combine_partials_equals_whole_row_logsumexp_and_argmax():
    """Split 3 rows of 10 scores into chunks of 4 (the kernel's per-chunk max, sum of exp, best
    score and its index) and merge: the same lse and argmax as over the whole row."""
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    temp = torch.tensor([0.0, 0.5, 2.0])
    scaled = logits / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    noisy = scaled + torch.randn(3, 10)
    noisy[0, 7] = noisy[0, 2] = noisy[0].max() + 1  # a tie across chunks: the first index wins
    best, idx, cmax, csum = [], [], [], []
    for lo in range(0, 10, 4):
        z, s = noisy[:, lo:lo + 4], scaled[:, lo:lo + 4]
        best.append(z.max(1).values)
        idx.append(z.argmax(1) + lo)
        cmax.append(s.max(1).values)
        csum.append((s - cmax[-1][:, None]).exp().sum(1))
    tok, lp = combine_partials(logits, temp, torch.stack(best, 1), torch.stack(idx, 1).int(),
                               torch.stack(cmax, 1), torch.stack(csum, 1))
    assert tok.tolist() == noisy.argmax(1).tolist() and tok[0].item() == 2
    expected = scaled.gather(1, tok[:, None]).squeeze(1) - torch.logsumexp(scaled, 1)
    assert torch.allclose(lp, expected, atol=1e-6)


def test_fast_sampler_flag_is_ignored_on_cpu():
    logits = torch.randn(4, 50)
    args = (logits, torch.ones(4), torch.ones(4), torch.full((4,), 50), torch.zeros(4, 1, dtype=torch.long),
            torch.zeros(4, 1, dtype=torch.bool), torch.arange(4), torch.zeros(4, dtype=torch.long), False)
    fast, slow = sample_tokens(*args, fast=True), sample_tokens(*args, fast=False)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
