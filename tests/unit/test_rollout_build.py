"""build_engine: names, options, the vLLM extra's error, and the protocol."""

from __future__ import annotations

import importlib.util

import pytest

from rlhfkit.rollout import build_engine
from rlhfkit.rollout.base import RolloutEngine
from rlhfkit.types import GenerationRequest, SamplingParams


def test_build_engines_from_a_path(tiny_model_dir):
    builtin = build_engine("builtin", tiny_model_dir, device="cpu", max_num_seqs=2, max_model_len=64)
    hf = build_engine("hf", tiny_model_dir, device="cpu")
    assert isinstance(builtin, RolloutEngine) and isinstance(hf, RolloutEngine)
    assert builtin.config.max_num_seqs == 2 and builtin.max_model_len == 64
    req = GenerationRequest([10, 11, 12], SamplingParams(temperature=0.0, max_new_tokens=6))
    assert builtin.generate([req])[0][0].token_ids == hf.generate([req])[0][0].token_ids


def test_build_engine_rejects_bad_names_and_options(tiny_model_dir):
    with pytest.raises(ValueError, match="--rollout_engine"):
        build_engine("sglang", tiny_model_dir)
    with pytest.raises(ValueError, match="max_batch"):
        build_engine("builtin", tiny_model_dir, device="cpu", max_batch=3)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_without_the_extra_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ImportError, match=r"pip install 'rlhfkit\[vllm\]'"):
        build_engine("vllm", tiny_model_dir)
