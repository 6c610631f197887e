"""Streamed HF export: several size-capped safetensors files + index that `from_pretrained` loads,
tied embeddings stored once, fp32 masters exported, stale files removed, no full state dict."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.checkpoint.hf_export import parse_size, safetensors_header, ExportTensor
from rlhfkit.config.configs import BackendConfig, OptimConfig

CPU = DistInfo(device="cpu")
LIMIT = 40_000  # bytes: the ~600 KB fp32 tiny model needs many files


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> str:
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_tied"))
    return make_tiny_model(path, TinyModelSpec(arch="qwen2", hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=256, tie_word_embeddings=True))


def trained_backend(model_dir: str, **cfg) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    low = cfg.get("param_dtype", "fp32") != "fp32"
    b = FSDP2Backend(model, BackendConfig(**{"param_dtype": "fp32", **cfg}), OptimConfig(learning_rate=1e-2), 5, CPU,
                     cpu_low_precision=low)
    ids = torch.randint(6, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    logits = b.model(input_ids=ids).logits.float()
    b.backward(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    b.optimizer_step()
    b.full_state_dict = lambda: pytest.fail("the streamed export gathered a full state dict")
    return b


def read_index(path: str) -> dict:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)


def logits_of(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(6, vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_sharded_export_round_trips_through_from_pretrained(tiny_model_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    b = trained_backend(tiny_model_dir)
    out = str(tmp_path / "hf")
    b.save_hf(out, max_shard_size=LIMIT)
    index = read_index(out)
    files = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(files) > 3 and files == sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    sd = b.model.state_dict()
    assert set(index["weight_map"]) == set(sd)  # every tensor, untied lm_head included
    stored = {}
    for name in files:
        with safe_open(os.path.join(out, name), framework="pt") as f:
            keys = list(f.keys())
            stored.update({k: name for k in keys})
            size = sum(f.get_tensor(k).numel() * 4 for k in keys)
        assert size <= LIMIT or len(keys) == 1  # a tensor above the limit gets a file of its own
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in sd.values())
    re = AutoModelForCausalLM.from_pretrained(out)
    assert re.config.architectures == ["LlamaForCausalLM"] and re.dtype == torch.float32
    for k, v in re.state_dict().items():
        assert torch.equal(v, sd[k]), k
    b.eval()
    assert torch.equal(logits_of(re, re.config.vocab_size), logits_of(b.model, re.config.vocab_size))


def test_tied_embeddings_are_stored_once_and_tied_on_load(tied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    b = trained_backend(tied_model_dir)
    assert b.model.lm_head.weight is b.model.model.embed_tokens.weight
    out = str(tmp_path / "hf")
    b.save_hf(out, max_shard_size=LIMIT)
    weight_map = read_index(out)["weight_map"]
    assert "model.embed_tokens.weight" in weight_map and "lm_head.weight" not in weight_map
    assert set(weight_map) == set(b.model.state_dict()) - {"lm_head.weight"}
    re = AutoModelForCausalLM.from_pretrained(out)
    assert re.lm_head.weight.data_ptr() == re.model.embed_tokens.weight.data_ptr()
    assert torch.equal(re.model.embed_tokens.weight, b.model.model.embed_tokens.weight.detach())
    b.eval()
    assert torch.equal(logits_of(re, re.config.vocab_size), logits_of(b.model, re.config.vocab_size))


def test_master_weights_exported_in_fp32_and_bf16(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    b = trained_backend(tiny_model_dir, param_dtype="bf16")
    assert b.master is not None and b.model.dtype == torch.bfloat16
    masters = dict(zip(b.master.names, b.master.masters))
    b.save_hf(str(tmp_path / "fp32"), max_shard_size=LIMIT)  # default: the base model's dtype (fp32 here)
    re = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32"))
    assert re.dtype == torch.float32
    for k, v in re.state_dict().items():
        assert torch.equal(v, masters[k]), k  # the fp32 masters, not their bf16 rounding
    b.save_hf(str(tmp_path / "bf16"), dtype=torch.bfloat16)  # default limit: one file
    assert sorted(n for n in os.listdir(tmp_path / "bf16") if "safetensors" in n) == ["model.safetensors"]
    re16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert re16.dtype == torch.bfloat16
    assert all(torch.equal(v, masters[k].to(torch.bfloat16)) for k, v in re16.state_dict().items())


def test_stale_weight_files_are_removed(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    b = trained_backend(tiny_model_dir)
    out = str(tmp_path / "hf")
    b.save_hf(out, max_shard_size=LIMIT)
    open(os.path.join(out, "notes.txt"), "w").close()
    b.save_hf(out)  # now one file: the shards and the index of the first export must go
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "notes.txt"]
    AutoModelForCausalLM.from_pretrained(out)
    b.save_hf(out, max_shard_size=LIMIT)
    assert "model.safetensors" not in os.listdir(out)  # would shadow the index on load
    AutoModelForCausalLM.from_pretrained(out)


def test_parse_size_and_header():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500 * 10**6 and parse_size(1234) == 1234 and parse_size("64KiB") == 65536
    for bad in ("5 gigabytes", "0", -1, "GB"):
        with pytest.raises(ValueError, match="--hf_max_shard_size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="--hf_max_shard_size"):
        FSDP2Backend(torch.nn.Linear(2, 2), BackendConfig(hf_max_shard_size="lots"), None, 1, CPU)
    head = safetensors_header([ExportTensor("a", torch.zeros(1), (2, 3), torch.bfloat16),
                               ExportTensor("b", torch.zeros(1), (), torch.int64)])
    n = int.from_bytes(head[:8], "little")
    assert n == len(head) - 8 and n % 8 == 0
    meta = json.loads(head[8:])
    assert meta["a"] == {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}
    assert meta["b"] == {"dtype": "I64", "shape": [], "data_offsets": [12, 20]}
    assert meta["__metadata__"] == {"format": "pt"}
