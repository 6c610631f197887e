"""Decode runner fallbacks (CPU): a sampler variant that fails to compile runs eagerly on its own,
and a failing decode step drops torch.compile before the Triton kernels; generations stay exact."""

from __future__ import annotations

import pytest

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.builtin.loop.sampling import sample_and_advance
from rlhfkit.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).eval()


def _engine(model) -> BuiltinEngine:
    cfg = BuiltinEngineConfig(max_num_seqs=3, max_model_len=96, sync_every=4)
    return BuiltinEngine(model, None, device="cpu", config=cfg, eos_token_ids=[])


def _tokens(engine: BuiltinEngine) -> list[list[int]]:
    """A plain request alone (unfiltered variants), then one beside a top-p / top-k one (filtered)."""
    plain = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    nucleus = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=12, seed=8)
    first = engine.generate([GenerationRequest([5, 6, 7, 8], plain, 0)])
    second = engine.generate([GenerationRequest([4, 3, 2], plain, 1), GenerationRequest([9, 10, 11], nucleus, 2)])
    return [o[0].token_ids for o in first + second]


def test_failing_sampler_variant_runs_eagerly_alone(qwen2):
    expected = _tokens(_engine(qwen2))
    engine = _engine(qwen2)
    calls = {"compiled": 0}

    def compiled_stand_in(state, rows, logits, filtered, max_model_len, fast=True):
        if filtered:
            raise RuntimeError("inductor failed")
        calls["compiled"] += 1
        return sample_and_advance(state, rows, logits, filtered, max_model_len, fast)

    engine.runner.compiled, engine.runner._sample = True, compiled_stand_in
    assert _tokens(engine) == expected
    assert engine.runner.compiled and calls["compiled"] > 0  # the unfiltered variants stayed "compiled"
    assert (True, True) in engine.runner._eager_sampler and (False, True) in engine.runner._eager_sampler
    assert (True, False) not in engine.runner._eager_sampler
    assert "sampler (all_rows=" in engine.runner.compile_error


def test_failing_decode_step_drops_compile_and_stays_exact(qwen2):
    expected = _tokens(_engine(qwen2))
    engine = _engine(qwen2)

    def broken_layer(*args):
        raise RuntimeError("inductor failed")

    engine.runner.compiled = True
    engine.model.layer_fn = broken_layer
    assert _tokens(engine) == expected
    assert not engine.runner.compiled and "inductor failed" in engine.runner.compile_error


def _count_syncs(engine: BuiltinEngine) -> dict:
    """Wrap the engine loop's `sync` to count its calls in the returned dict's "n"."""
    syncs = {"n": 0}
    orig = engine.loop.sync

    def counting(*args) -> None:
        syncs["n"] += 1
        orig(*args)

    engine.loop.sync = counting
    return syncs


def test_generate_syncs_every_sync_every_batch_steps_unless_requests_wait(qwen2):
    """40 new tokens: a batch generate() syncs every 16 steps (3 syncs) and returns the same tokens as
    syncing every 4 (10 syncs); the agenerate-style path keeps syncing every 4."""
    def run(batch_every: int, n_requests: int = 2) -> tuple[list[list[int]], int]:
        cfg = BuiltinEngineConfig(max_num_seqs=2, max_model_len=96, sync_every=4, sync_every_batch=batch_every)
        engine = BuiltinEngine(qwen2, None, device="cpu", config=cfg, eos_token_ids=[])
        syncs = _count_syncs(engine)
        reqs = [GenerationRequest([5 + i, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=40, seed=i), i)
                for i in range(n_requests)]
        return [o[0].token_ids for o in engine.generate(reqs)], syncs["n"]

    fast, n_fast = run(16)
    slow, n_slow = run(4)
    assert fast == slow and n_fast == 3 and n_slow == 10
    # a third request waits for a slot: until it is admitted, syncs come every 4 steps
    _, n_wait = run(16, n_requests=3)
    assert n_wait > 3 + 3


def _lookahead_run(model, ahead: int, stop_ids: list[int] | None = None) -> tuple[list, list, int, int]:
    cfg = BuiltinEngineConfig(max_num_seqs=4, max_model_len=96, sync_every=4, sync_every_batch=16,
                              lookahead_steps=ahead)
    engine = BuiltinEngine(model, None, device="cpu", config=cfg, eos_token_ids=[])
    syncs = _count_syncs(engine)
    stops = {"stop_token_ids": stop_ids} if stop_ids else {}
    reqs = [GenerationRequest([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=40, seed=3, n=2,
                                                        logprobs=True, **stops), 0),
            GenerationRequest([9, 4], SamplingParams(temperature=1.0, max_new_tokens=25, seed=4, logprobs=True,
                                                     **stops), 1)]
    outs = [c for o in engine.generate(reqs) for c in o]
    return [c.token_ids for c in outs], [c.logprobs for c in outs], syncs["n"], engine.stats.decode_steps


def _same_logprobs(a: list[list[float]], b: list[list[float]]) -> bool:
    """Equal up to float rounding: a look-ahead step may run a batch of another size (rows that ended
    still in it), and on some CPUs (AVX-512) the matmul kernel then sums in another order (seen: 5e-7)."""
    return [len(x) for x in a] == [len(x) for x in b] and all(
        abs(p - q) <= 1e-5 for x, y in zip(a, b) for p, q in zip(x, y))


def test_lookahead_keeps_every_token_and_wastes_no_step_on_lengths(qwen2):
    """Batch-mode syncs read the flags while `lookahead_steps` more steps run: the same tokens and
    log-probs as without, the same number of decode steps when rows end by length, and the rows
    that finish during a look-ahead are picked up at the next sync. The tokens arrive on the host
    a chunk at a time (`Sequence.read`), each exactly once."""
    toks, lps, syncs, steps = _lookahead_run(qwen2, 0)
    toks_a, lps_a, syncs_a, steps_a = _lookahead_run(qwen2, 3)
    assert toks_a == toks and _same_logprobs(lps_a, lps) and [len(t) for t in toks] == [40, 40, 25]
    assert steps_a == steps == 39 and syncs <= syncs_a <= syncs + 1  # + 1: the last chunk is read before its end
    # stop ids taken from the generations themselves: rows end early, mid-chunk and mid-look-ahead
    stop_ids = [toks[0][6], toks[1][17], toks[2][19]]
    toks, lps, _, _ = _lookahead_run(qwen2, 0, stop_ids)
    for ahead in (1, 3, 7):
        toks_a, lps_a, _, steps_a = _lookahead_run(qwen2, ahead, stop_ids)
        assert toks_a == toks and _same_logprobs(lps_a, lps), ahead
    assert all(len(t) < 40 for t in toks[:2])
