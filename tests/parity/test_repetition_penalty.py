"""Repetition penalty (HF / vLLM semantics) in the rollout engines, on CPU against HF `generate`:

greedy tokens equal HF's with the same penalty (mixed prompt lengths, penalised and plain requests
in one batch, n > 1 samples sharing a prefill), the penalty changes what is generated, and the
reported log-probs stay those of the unpenalised temperature-scaled distribution.
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.hf_engine import HFEngine
from rlhfkit.types import GenerationRequest, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [7, 7, 7]]
NEW = 24


@pytest.fixture(scope="module")
def model(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], penalty: float) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                         repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _builtin(model, **cfg) -> BuiltinEngine:
    config = BuiltinEngineConfig(max_num_seqs=6, max_model_len=64, sync_every=5, **cfg)
    return BuiltinEngine(model, None, device="cpu", config=config, eos_token_ids=[])


def test_builtin_greedy_penalty_matches_hf(model):
    engine = _builtin(model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    reqs = [GenerationRequest(p, greedy.replace(repetition_penalty=1.6 if i % 2 == 0 else 1.0), i)
            for i, p in enumerate(PROMPTS)]
    outs = [o[0].token_ids for o in engine.generate(reqs)]
    changed = 0
    for i, (p, got) in enumerate(zip(PROMPTS, outs)):
        penalty = 1.6 if i % 2 == 0 else 1.0
        assert got == _hf_greedy(model, p, penalty), f"prompt {i} (penalty {penalty})"
        if penalty != 1.0:
            changed += got != _hf_greedy(model, p, 1.0)
    assert changed >= 1  # the penalty is not a no-op on these prompts
    # a later plain batch on the same engine (the presence mask stays allocated) is unaffected
    assert [o[0].token_ids for o in engine.generate(reqs[1:2])] == [outs[1]]


def test_builtin_penalty_below_one_and_shared_prefill(model):
    engine = _builtin(model)
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW, repetition_penalty=0.7, n=2)
    outs = engine.generate([GenerationRequest(PROMPTS[0], sp, 0), GenerationRequest(PROMPTS[3], sp, 1)])
    for p, comps in zip((PROMPTS[0], PROMPTS[3]), outs):
        ref = _hf_greedy(model, p, 0.7)
        assert [c.token_ids for c in comps] == [ref, ref]
    assert engine.stats.prefill_sequences == 2


def test_builtin_sampled_logprobs_are_unpenalised(model):
    engine = _builtin(model)
    sp = SamplingParams(temperature=0.8, max_new_tokens=16, repetition_penalty=1.5, seed=3, n=2)
    outs = engine.generate([GenerationRequest(p, sp, i) for i, p in enumerate(PROMPTS[:3])])
    with torch.no_grad():
        for p, comps in zip(PROMPTS, outs):
            for c in comps:
                logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1] / 0.8
                ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
                torch.testing.assert_close(torch.tensor(c.logprobs), ref, rtol=0, atol=1e-4)
    # seeded: the same request gives the same samples again
    again = engine.generate([GenerationRequest(p, sp, i) for i, p in enumerate(PROMPTS[:3])])
    assert [[c.token_ids for c in o] for o in again] == [[c.token_ids for c in o] for o in outs]


def test_hf_engine_passes_the_penalty(model):
    engine = HFEngine(model, None, device="cpu", eos_token_ids=[], max_batch_size=1)
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW, repetition_penalty=1.6)
    outs = engine.generate([GenerationRequest(p, sp, i) for i, p in enumerate(PROMPTS[:2])])
    assert [o[0].token_ids for o in outs] == [_hf_greedy(model, p, 1.6) for p in PROMPTS[:2]]


def test_penalty_must_be_positive(model):
    with pytest.raises(ValueError, match="repetition_penalty"):
        _builtin(model).generate([GenerationRequest([1, 2], SamplingParams(repetition_penalty=0.0), 0)])
