"""A tensor-parallel builtin engine (2 shards over gloo, CPU, fp32) serving vision-language models: its
log-probs for picture + text prompts equal the training forward's within 1e-5 (before and after a
weight update that changes the vision tower too), its tokens equal the unsharded engine's, and each
shard runs its replica of the vision tower once per batch of new pictures (n = 3 samples and a greedy
request of the same prompt: one call; after the update, one more).

Qwen2.5-VL (q/k/v biases; 4 heads, 2 KV heads: one per shard) and Qwen3-VL (q/k norms, interleaved
M-RoPE, a deepstack layer).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_engine_tp import run_shards

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_tp2_vlm_engine_equals_training_forward(arch, tiny_vlm_dir, tiny_qwen3_vl_dir, tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    model_dir = tiny_vlm_dir if arch == "qwen2_5_vl" else tiny_qwen3_vl_dir
    rep = run_shards(model_dir, str(tmp_path / "out.json"), worker="vlm_tp_worker.py")
    assert rep["heads"] == 2  # 4 heads split over 2 shards
    assert rep["tokens"] > 30
    assert rep["before_gap"] < 1e-5 and rep["after_gap"] < 1e-5, rep
    assert rep["before_same_as_tp1"]
    assert rep["update_changed"], "the weight update changed no generation: a vacuous check"
    assert rep["tower_calls_before"] == 1 and rep["tower_calls"] == 2
    with open(str(tmp_path / "out.json") + ".rank1") as f:
        other = json.load(f)
    assert other["tower_calls"] == 2 and other["ops"] > 5  # shard 1 ran its own tower replica in step
