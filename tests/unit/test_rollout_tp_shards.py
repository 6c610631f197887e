"""Tensor-parallel sharding rules of the builtin engine's weights (no process group needed).

Shards are built with `load_from_safetensors(..., shard=(rank, size, None))` and glued back
together by hand: q/k/v rows per head, o / down columns, gate / up rows, lm_head rows. The glued
tensors must equal the unsharded engine's, which proves every slice lands in the right place.
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.rollout.builtin.model.weights import load_from_hf_model, load_from_safetensors


def _shards(path: str, size: int):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    return [load_from_safetensors(path, cfg, torch.float32, torch.device("cpu"), (r, size, None)) for r in range(size)]


def test_shards_glue_back_to_the_full_weights(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    full_spec, full = load_from_hf_model(AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir), torch.float32,
                                         torch.device("cpu"))
    shards = _shards(tiny_qwen2_dir, 2)
    (s0, w0), (s1, w1) = shards
    q, kv, i = s0.q_size, s0.kv_size, s0.intermediate_size
    assert (q, kv, i) == (32, 16, 128) and full_spec.q_size == 64
    for li, layer in enumerate(full.layers):
        parts = [w.layers[li] for _, w in shards]
        qs = torch.cat([p.qkv[:q] for p in parts])
        ks = torch.cat([p.qkv[q:q + kv] for p in parts])
        vs = torch.cat([p.qkv[q + kv:] for p in parts])
        torch.testing.assert_close(torch.cat([qs, ks, vs]), layer.qkv, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p.qkv_bias[:q] for p in parts]), layer.qkv_bias[:64], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p.o for p in parts], dim=1), layer.o, rtol=0, atol=0)
        gate = torch.cat([p.gate_up[:i] for p in parts])
        up = torch.cat([p.gate_up[i:] for p in parts])
        torch.testing.assert_close(torch.cat([gate, up]), layer.gate_up, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p.down for p in parts], dim=1), layer.down, rtol=0, atol=0)
        torch.testing.assert_close(parts[1].input_norm, layer.input_norm, rtol=0, atol=0)  # replicated
    vocab = full_spec.vocab_size  # 103: shard 1 has one padding row of zeros
    lm = torch.cat([w0.lm_head, w1.lm_head])
    torch.testing.assert_close(lm[:vocab], full.lm_head, rtol=0, atol=0)
    assert lm.shape[0] == 104 and lm[vocab:].abs().sum() == 0
    torch.testing.assert_close(w1.embed, full.embed, rtol=0, atol=0)


def test_replicated_kv_heads_go_to_the_shards_of_their_query_heads(tiny_qwen2_dir):
    (s0, w0), (s1, w1), (s2, w2), (s3, w3) = _shards(tiny_qwen2_dir, 4)  # 4 query heads, 2 KV heads
    assert s0.num_heads == 1 and s0.num_kv_heads == 1
    q, kv = s0.q_size, s0.kv_size
    k = [w.layers[0].qkv[q:q + kv] for w in (w0, w1, w2, w3)]
    torch.testing.assert_close(k[0], k[1], rtol=0, atol=0)  # query heads 0, 1 read KV head 0
    torch.testing.assert_close(k[2], k[3], rtol=0, atol=0)  # query heads 2, 3 read KV head 1
    assert not torch.equal(k[0], k[2])


def test_shard_errors_name_the_sizes():
    spec = ModelSpec("qwen2", 100, 64, 2, 6, 2, 16, 96, 1e-6, False, False, 128)
    with pytest.raises(ValueError, match="must divide the model's 6 attention heads"):
        spec.shard(0, 4, None)
    with pytest.raises(ValueError, match="3 and the model's 2 KV heads"):
        spec.shard(0, 3, None)
    odd = ModelSpec("qwen2", 100, 64, 2, 4, 4, 16, 90, 1e-6, False, False, 128)
    with pytest.raises(ValueError, match="intermediate size 90"):
        odd.shard(0, 4, None)
    with pytest.raises(ValueError, match="already a shard"):
        spec.shard(0, 2, None).shard(0, 2, None)
