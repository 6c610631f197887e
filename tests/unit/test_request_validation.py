"""Request validation shared by the rollout engines: each bad setting raises a ValueError that names
the request and the field; good requests pass."""

from __future__ import annotations

import pytest

from rlhfkit.rollout.engine_utils import validate_request
from rlhfkit.types import GenerationRequest, SamplingParams


@pytest.mark.parametrize("field,value,words", [
    ("n", 0, "SamplingParams.n must be >= 1"),
    ("max_new_tokens", 0, "SamplingParams.max_new_tokens"),
    ("min_new_tokens", -1, "SamplingParams.min_new_tokens"),
    ("temperature", -0.5, "SamplingParams.temperature"),
    ("top_p", 0.0, "SamplingParams.top_p"),
    ("top_p", 1.5, "SamplingParams.top_p"),
    ("repetition_penalty", 0.0, "SamplingParams.repetition_penalty"),
    ("stop_token_ids", [3, 100], "SamplingParams.stop_token_ids"),
    ("stop", ["ok", ""], "SamplingParams.stop"),
])
def test_bad_sampling_params_name_the_field(field, value, words):
    req = GenerationRequest([1, 2, 3], SamplingParams(**{field: value}), request_id=7)
    with pytest.raises(ValueError, match="request 7") as err:
        validate_request(req, vocab_size=100, max_model_len=64)
    assert words in str(err.value)


def test_bad_prompts_are_refused_and_good_requests_pass():
    sp = SamplingParams(max_new_tokens=4, stop_token_ids=[5], stop=["\n"])
    validate_request(GenerationRequest([0, 99], sp, 1), vocab_size=100, max_model_len=64)
    for ids, words in (([], "empty"), ([1, 100], "[0, 100)"), ([-1], "[0, 100)"), (list(range(64)), "max_model_len")):
        with pytest.raises(ValueError, match="request 2") as err:
            validate_request(GenerationRequest(ids, sp, 2), vocab_size=100, max_model_len=64)
        assert words in str(err.value)
