"""A tensor-parallel builtin engine (2 shards over gloo, CPU, fp32) == the unsharded engine.

Greedy tokens must be equal and log-probs within 1e-5 (the all-reduced o / down projections sum
the same fp32 products in another order: ~1e-7 relative), before and after a weight update, after
sleep / wake, and through the async API. Seeded sampling (n = 3), top-k / top-p and a repetition
penalty are compared too: the shards all-gather the full logits and draw with the same
counter-based noise, so the samples agree wherever the logits agree to fp32 rounding.

Two model shapes cover the sharding rules: Qwen2 with 4 heads / 2 KV heads (one KV head per shard,
q/k/v biases, untied lm_head) and Llama with 4 heads / 1 KV head (the KV head replicated on both
shards) and tied embeddings; the character tokenizer's vocabulary (103 ids) is odd, so the second
shard's lm_head rows are padded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import free_port, pythonpath  # noqa: E402

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))



def run_shards(model_dir: str, out: str, nproc: int = 2, worker: str = "engine_tp_worker.py") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), os.path.join(HERE, worker), model_dir, out]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def llama_one_kv_tied(tmp_path_factory) -> str:
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tp_llama"))
    return make_tiny_model(path, TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=1,
                                               tie_word_embeddings=True, max_position_embeddings=256, seed=3))


@pytest.mark.parametrize("shape", ["qwen2_gqa", "llama_one_kv_tied"])
def test_tp2_engine_equals_tp1(shape, tiny_qwen2_dir, llama_one_kv_tied, tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    model_dir = tiny_qwen2_dir if shape == "qwen2_gqa" else llama_one_kv_tied
    rep = run_shards(model_dir, str(tmp_path / "out.json"))
    shard = rep["shard"]
    assert shard["heads"] == 2 and shard["kv_heads"] == 1 and shard["intermediate"] == 128
    assert shard["lm_head_rows"] == 52  # ceil(103 / 2): the second shard holds one padding row
    for phase in ("before", "async", "after", "after_wake"):
        r = rep[phase]
        assert r["same_tokens"], f"{phase}: tokens differ from the unsharded engine"
        assert r["tokens"] > 50
        assert r["max_logprob_gap"] < 1e-5, f"{phase}: log-prob gap {r['max_logprob_gap']}"
    assert rep["update_changed_outputs"], "the weight update did not change any generation: a vacuous check"
    with open(str(tmp_path / "out.json") + ".rank1") as f:
        other = json.load(f)
    assert other["ops"] > 10 and other["lm_head_rows"] == 52  # shard 1 ran the mirrored steps
