"""bench/harness/models.py's streamed shapes: a scaled-down Qwen2 written tensor by tensor into
several safetensors shards reads back through `AutoModelForCausalLM.from_pretrained` equal to the
values the writer drew, and the random init gives finite, O(1) activations and generations."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.* imports from here
sys.path.insert(0, ROOT)
from bench.harness import models as B  # noqa: E402

sys.path.remove(ROOT)

SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=160, vocab_size=400, tie_word_embeddings=False, max_position_embeddings=256,
             rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def test_full_shapes_have_the_published_sizes():
    n7 = sum(math.prod(s) for _, s, _ in B.qwen2_tensors(B.QWEN25_7B))
    n32 = sum(math.prod(s) for _, s, _ in B.qwen2_tensors(B.QWEN25_32B))
    assert n7 == 7_615_616_512  # Qwen2.5-7B (worked out in tests/unit/test_memory_plan.py)
    # 64 x (2*5120*5120 + 2*5120*1024 + 3*5120*27648 + 2*5120 + 5120 + 2*1024) + 2*152064*5120 + 5120
    assert n32 == 32_763_876_352


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen2_small"))
    B.make_bench_model(path, SMALL, device="cpu", seed=5, max_shard_bytes=100_000)
    return path


def test_sharded_checkpoint_layout(small_dir):
    with open(os.path.join(small_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = B.qwen2_tensors(SMALL)
    assert index["weight_map"].keys() == {n for n, _, _ in tensors}
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == 2 * sum(math.prod(s) for _, s, _ in tensors)
    for name in files:  # data part of every shard <= the limit (one tensor never exceeds it here)
        size = os.path.getsize(os.path.join(small_dir, name))
        with open(os.path.join(small_dir, name), "rb") as f:
            header = int.from_bytes(f.read(8), "little")
        assert size - 8 - header <= 100_000 and header % 8 == 0
    cfg = json.load(open(os.path.join(small_dir, "config.json")))
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["dtype"] == "bfloat16"


def test_loader_reads_back_what_was_drawn(small_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    tensors = B.qwen2_tensors(SMALL)
    assert params.keys() == {n for n, _, _ in tensors}
    for name, shape, init in tensors:
        assert torch.equal(params[name], B.tensor_values(name, shape, init, 5, "cpu")), name
    w = params["model.layers.1.mlp.up_proj.weight"].float()
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(params["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert not torch.equal(params["model.layers.0.mlp.up_proj.weight"], params["model.layers.1.mlp.up_proj.weight"])
    # another seed draws other values
    assert not torch.equal(B.tensor_values("lm_head.weight", (400, 64), "normal", 6, "cpu"), params["lm_head.weight"])


def test_random_init_gives_sane_activations_and_generations(small_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(small_dir)
    assert len(tok) == 400
    ids = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, output_hidden_states=True)
    assert torch.isfinite(out.logits).all() and 0.01 < out.logits.std().item() < 10
    assert all(0.01 < h.std().item() < 10 for h in out.hidden_states)
    gen = model.generate(ids[:, :8], max_new_tokens=8, do_sample=True, min_new_tokens=8)
    assert gen.shape == (2, 16)


def test_cli_writes_a_shape(tmp_path, monkeypatch):
    monkeypatch.setitem(B.STREAMED, "qwen2.5-7b", SMALL)  # the CLI path, at test size
    monkeypatch.setattr(sys, "argv", ["models.py", "--shape", "qwen2.5-7b", "--out", str(tmp_path / "m"),
                                      "--device", "cpu", "--max_shard_gb", "0.0001"])
    B.main()
    assert os.path.exists(tmp_path / "m" / "model.safetensors.index.json")
    assert os.path.exists(tmp_path / "m" / "tokenizer.json")
