"""Shared fixtures: offline tiny models (nothing is downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer, hidden-64 Llama with the character tokenizer (about 145k parameters)."""
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_llama"))
    return make_tiny_model(path, TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, max_position_embeddings=256))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """A 2-layer Qwen2 (grouped-query attention: 4 heads, 2 kv heads)."""
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    return make_tiny_model(path, TinyModelSpec(arch="qwen2", hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=256))


@pytest.fixture(scope="session")
def tiny_long_model_dir(tmp_path_factory) -> str:
    """The tiny Llama with 8192 positions, for seed commands whose --max_len is 4096 or 8192
    (a --max_len beyond the model's positions is an error)."""
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_llama_8k"))
    return make_tiny_model(path, TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, max_position_embeddings=8192))
