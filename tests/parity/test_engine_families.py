"""Builtin engine vs HF greedy `generate` across model families and config options (CPU, fp32).

Each case builds a small random model from a config (no files): Qwen3 (q/k RMSNorm, explicit
head_dim), Llama with llama3 rope scaling, attention and MLP biases, Mistral (also with a sliding window
of 16 tokens, far shorter than the sequences), tied embeddings. The newer families are in
test_engine_new_families.py.
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.builtin.model.rope import rope_tables
from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.types import GenerationRequest, SamplingParams

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "qwen3":
        return Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=24)
    if kind == "llama3_rope":
        return LlamaConfig(**COMMON, num_key_value_heads=2, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "llama_bias":
        return LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)
    if kind == "mistral":
        return MistralConfig(**COMMON, num_key_value_heads=1, sliding_window=4096)
    if kind == "mistral_window":  # a window far shorter than prompt + completion
        return MistralConfig(**COMMON, num_key_value_heads=1, sliding_window=16)
    if kind == "qwen2_tied":
        return Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True)
    raise ValueError(kind)


def _model(kind: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind)).eval()
    with torch.no_grad():  # random biases and norm gains, so that they matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("kind", ["qwen3", "llama3_rope", "llama_bias", "mistral", "mistral_window", "qwen2_tied"])
def test_family_greedy_parity(kind):
    model = _model(kind)
    engine = BuiltinEngine(model, None, device="cpu",
                           config=BuiltinEngineConfig(max_num_seqs=3, max_model_len=200, sync_every=4))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (4, 70, 11, 30)]
    max_new = [20, 60, 9, 30]
    outs = engine.generate([GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=m), i)
                            for i, (p, m) in enumerate(zip(prompts, max_new))])
    for p, m, (c,) in zip(prompts, max_new, outs):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=m,
                             pad_token_id=0)[0, len(p):].tolist()
        assert c.token_ids == ref


def test_llama3_rope_tables_equal_hf_rotary_embedding():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config("llama3_rope")
    spec = ModelSpec.from_hf_config(config)
    cos, sin = rope_tables(config, spec, 200, torch.float32, torch.device("cpu"))
    x = torch.zeros(1, 200, spec.head_dim)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(x, torch.arange(200)[None])
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=1e-6)
    plain = ModelSpec.from_hf_config(_config("llama_bias"))
    cos_plain, _ = rope_tables(_config("llama_bias"), plain, 200, torch.float32, torch.device("cpu"))
    assert not torch.allclose(cos_plain[:, :8], cos[:, :8])  # the scaling did change low frequencies


def test_unsupported_models_raise_clear_errors():
    from transformers import GPT2Config, Qwen2Config

    with pytest.raises(ValueError, match="model_type"):
        ModelSpec.from_hf_config(GPT2Config())
    cfg = Qwen2Config(**COMMON, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope type"):
        rope_tables(cfg, ModelSpec.from_hf_config(cfg), 16, torch.float32, torch.device("cpu"))
