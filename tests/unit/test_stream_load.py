"""Streamed loading (rlhfkit.models.stream_load): models built on the meta device with the checkpoint read
into them chunk by chunk equal transformers' loader bit for bit (weights, ties, rotary buffers, LoRA's
initial adapters, a training step), and checkpoints whose names transformers converts are loaded whole."""

from __future__ import annotations

import logging

import pytest
import torch

from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig
from rlhfkit.models import stream_load
from rlhfkit.models.loader import load_causal_lm


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> str:
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tied_qwen2"))
    return make_tiny_model(path, TinyModelSpec(arch="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, max_position_embeddings=256,
                                               tie_word_embeddings=True))


def _reference(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _no_transformers_loading(monkeypatch) -> None:
    """Any model loaded whole by transformers fails the test (the streamed path must be taken)."""
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("loaded with from_pretrained, not streamed")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("which", ["untied", "tied"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streamed_onto_the_device_equals_from_pretrained(which, dtype, tiny_model_dir, tied_dir, monkeypatch):
    path = tied_dir if which == "tied" else tiny_model_dir
    ref = _reference(path, torch.float32 if dtype == "fp32" else torch.bfloat16)
    monkeypatch.setattr(stream_load, "CHUNK_BYTES", 1000)  # many chunks per tensor, one row at least
    _no_transformers_loading(monkeypatch)
    got = load_causal_lm(ModelConfig(pretrain=path, param_dtype=dtype), device="cpu")
    assert not any(p.is_meta for p in got.parameters()) and not got.training
    want, have = ref.state_dict(), got.state_dict()
    assert list(have) == list(want)
    for k in want:
        assert have[k].dtype == want[k].dtype and torch.equal(have[k], want[k]), k
    for (n, b), (_, rb) in zip(got.named_buffers(), ref.named_buffers()):  # rotary inv_freq, computed for real
        assert torch.equal(b, rb), n
    tied = got.lm_head.weight is got.model.embed_tokens.weight
    assert tied == (which == "tied") == (ref.lm_head.weight is ref.model.embed_tokens.weight)
    assert got.generation_config.to_dict() == ref.generation_config.to_dict() and got.name_or_path == path
    ids = torch.randint(0, 40, (2, 9))
    assert torch.equal(got(ids).logits, ref(ids).logits)


def test_a_deferred_lora_policy_trains_as_the_whole_loaded_one(tied_dir, monkeypatch):
    """The trainers' path: meta parameters until the backend places the model; peft's adapters start
    from the same random numbers; the loss and the weights after a step are those of the old path."""
    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.parallel.dist import DistInfo

    cfg = ModelConfig(pretrain=tied_dir, param_dtype="bf16", lora_rank=4, lora_alpha=8)
    runs = []
    for defer in (False, True):
        torch.manual_seed(0)
        model = load_causal_lm(cfg, master_dtype="fp32", defer_weights=defer)
        base = [p for n, p in model.named_parameters() if "lora_" not in n]
        adapters = [p for n, p in model.named_parameters() if "lora_" in n]
        assert adapters and not any(p.is_meta for p in adapters)
        assert all(p.is_meta for p in base) == defer and stream_load.has_pending_weights(model) == defer
        start = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        b = FSDP2Backend(model, BackendConfig(zero_stage=2, param_dtype="bf16", device="cpu"),
                         OptimConfig(learning_rate=1e-2), 2, DistInfo(device="cpu"))
        ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = b.forward(ids, labels=ids).loss
        b.backward(loss)
        b.optimizer_step()
        runs.append((start, float(loss.detach()), {k: v.clone() for k, v in b.model.state_dict().items()}))
    (start0, loss0, sd0), (start1, loss1, sd1) = runs
    assert all(torch.equal(start0[k], start1[k]) for k in start0) and any(v.abs().sum() > 0 for v in start0.values())
    assert loss0 == loss1
    assert list(sd0) == list(sd1) and all(torch.equal(sd0[k], sd1[k]) for k in sd0)


def test_read_box_reads_a_slice_of_rows_and_columns(tmp_path, monkeypatch):
    """A shard (a block of rows, of columns under tensor parallelism) read in chunks of rows, cast
    through the load dtype as transformers' loader would."""
    from safetensors.torch import save_file

    full = torch.randn(37, 11, dtype=torch.float32)
    save_file({"w": full, "s": torch.tensor(2.5)}, str(tmp_path / "model.safetensors"))
    index = stream_load.safetensors_index(str(tmp_path))
    monkeypatch.setattr(stream_load, "CHUNK_BYTES", 3 * 11 * 4)  # 3 rows a read
    dst = torch.empty(20, 4, dtype=torch.float32)
    assert stream_load._read_box(index["w"], dst, (5, 6), torch.bfloat16) == 20 * 11 * 4  # whole rows read
    assert torch.equal(dst, full[5:25, 6:10].to(torch.bfloat16).float())
    scalar = torch.empty((), dtype=torch.float32)
    stream_load._read_box(index["s"], scalar, (), torch.float32)
    assert float(scalar) == 2.5


def test_a_converted_checkpoint_is_loaded_whole_with_a_note(tmp_path, caplog):
    """transformers 5 fuses a mixture of experts' per-expert checkpoint tensors into 3-D weights: names
    differ, so transformers loads it (a note says so), the same weights either way."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64, head_dim=8)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="rlhfkit.config.notes"):
        got = load_causal_lm(ModelConfig(pretrain=str(tmp_path), param_dtype="fp32"), defer_weights=True)
    assert not stream_load.has_pending_weights(got) and not any(p.is_meta for p in got.parameters())
    assert "no checkpoint tensor for parameter model.layers.0.mlp.experts" in caplog.text
    assert "loaded whole by transformers" in caplog.text
    ref = _reference(str(tmp_path), torch.float32).state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in got.state_dict().items())
