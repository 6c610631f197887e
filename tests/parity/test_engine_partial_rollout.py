"""Partial rollout in the builtin engine (issue 15, part 2): weights updated between decode steps
while a long generation is in flight, as vLLM's pause_generation(mode="keep") / resume.

The update replaces only `lm_head.weight` (the tiny Llama's head is not tied to its embedding), so
the K/V of every position are the same under both versions and a teacher-forced forward gives
the exact log-prob of each token under the weights that sampled it: the engine's log-probs of the
tokens before the update must be those of version 0, after it those of version 1 (the sequence
keeps its slot and KV cache: one prefill). The tokens before the update equal a run without it.

The update lands after a fixed number of engine steps: a wrapper of the engine's step pauses the
engine from its own worker thread (the lock is re-entrant), the test thread then loads the
weights and resumes.

RL level: the same mixed-version completion through the single-turn executor gives a trajectory
whose `policy_versions` hold both versions, and the IS correction (TIS / ICEPOP) weights each token
with its own rollout log-prob: exp(log pi_old - log pi_rollout) is 1 on the version-1 tokens when
pi_old is version 1 and the ratio of the two heads on the version-0 tokens.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.types import GenerationRequest, SamplingParams

CFG = BuiltinEngineConfig(max_num_seqs=4, max_model_len=160, sync_every=1, max_prefill_tokens=64)
NEW = 40
PAUSE_AFTER = 10  # engine steps
PROMPT = [5, 17, 33, 8, 61, 12, 9]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=NEW, min_new_tokens=NEW, seed=11)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert not old.config.tie_word_embeddings
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        new.lm_head.weight.add_(torch.randn(new.lm_head.weight.shape, generator=g) * 0.5)
    return old, new, AutoTokenizer.from_pretrained(tiny_model_dir)


def teacher(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return F.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


def pausing_engine(model, tok) -> tuple[BuiltinEngine, threading.Event]:
    """An engine that pauses itself after PAUSE_AFTER steps; the event is set when it has."""
    engine = BuiltinEngine(model, tok, device="cpu", config=CFG)
    real, count, paused = engine.loop.step, [0], threading.Event()

    def step(batch: bool = False) -> None:
        real(batch)
        count[0] += 1
        if count[0] == PAUSE_AFTER:
            engine.pause()
            paused.set()
    engine.loop.step = step
    return engine, paused


def split(versions: list[int]) -> int:
    k = versions.index(1)
    assert versions == [0] * k + [1] * (len(versions) - k), versions
    return k


def test_generation_continues_across_a_weight_update(models):
    old, new, tok = models
    [[ref]] = BuiltinEngine(old, tok, device="cpu", config=CFG).generate([GenerationRequest(PROMPT, PARAMS)])
    assert ref.policy_versions == [0] * NEW

    engine, paused = pausing_engine(old, tok)

    async def run():
        task = asyncio.ensure_future(engine.agenerate(GenerationRequest(PROMPT, PARAMS)))
        assert await asyncio.to_thread(paused.wait, 60)
        # paused with the request in flight: it keeps its slot, nothing advances, a new request waits
        (seq,) = engine.sched.running.values()
        steps, made = engine.stats.decode_steps, seq.gen_bound
        assert engine.paused and 0 < made < NEW
        late = asyncio.ensure_future(engine.agenerate(GenerationRequest(PROMPT[:4], PARAMS.replace(seed=5))))
        await asyncio.sleep(0.2)
        assert engine.stats.decode_steps == steps and engine.stats.prefill_calls == 1 and not late.done()
        # two "buckets" loaded while paused, then the version of the whole update
        await asyncio.to_thread(engine.update_weights_local, [("lm_head.weight", new.lm_head.weight)])
        await asyncio.to_thread(engine.update_weights_local, [("model.norm.weight", new.model.norm.weight)])
        engine.resume(version=1)
        return await task, await late, made

    [c], [c_late], made = asyncio.run(run())
    engine.close()
    k = split(c.policy_versions)
    assert k == made  # the span boundary is where the engine stood when paused
    assert c.token_ids[:k] == ref.token_ids[:k]
    torch.testing.assert_close(torch.tensor(c.logprobs[:k]), torch.tensor(ref.logprobs[:k]), rtol=0, atol=1e-6)
    assert c.token_ids[k:] != ref.token_ids[k:]  # the new head samples other tokens
    # each token's log-prob is that of the weights that sampled it (one prefill: the KV cache was kept)
    assert engine.stats.prefill_calls == 2  # the first request's and the late one's
    lp_old, lp_new = teacher(old, PROMPT, c.token_ids), teacher(new, PROMPT, c.token_ids)
    torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lp_old[:k] + lp_new[k:]), rtol=0, atol=1e-4)
    assert max(abs(a - b) for a, b in zip(lp_old[k:], lp_new[k:])) > 0.1  # the versions differ there
    # the request that arrived while paused ran entirely on version 1
    assert c_late.policy_versions == [1] * NEW
    torch.testing.assert_close(torch.tensor(c_late.logprobs), torch.tensor(teacher(new, PROMPT[:4], c_late.token_ids)),
                               rtol=0, atol=1e-4)


def test_update_weights_between_steps_counts_versions_and_generate_waits_while_paused(models):
    old, _, tok = models
    engine = BuiltinEngine(old, tok, device="cpu", config=CFG)
    engine.update_weights([("lm_head.weight", old.lm_head.weight)])  # one whole update: version 1
    assert engine.policy_version == 1
    engine.pause()
    out: list = []
    worker = threading.Thread(target=lambda: out.append(engine.generate([GenerationRequest(PROMPT, PARAMS)])))
    worker.start()
    time.sleep(0.2)
    assert not out and engine.stats.prefill_calls == 0  # generate() does not step while paused
    engine.resume(version=7)
    worker.join(60)
    [[[c]]] = out
    assert c.policy_versions == [7] * NEW


def test_executor_trajectory_and_is_correction_are_per_token(models):
    from rlhfkit.agents.base import AgentConfig
    from rlhfkit.agents.executors import SingleTurnAgentExecutor
    from rlhfkit.algo.experience import pad_trajectories
    from rlhfkit.losses.correction import is_correction_weights
    from rlhfkit.models.forward import token_logprobs
    from rlhfkit.types import PromptSample

    old, new, tok = models
    engine, paused = pausing_engine(old, tok)

    ex = SingleTurnAgentExecutor().setup(engine, tok, AgentConfig(max_length=120, sampling_params=PARAMS))
    prompt = "12+34=? let us see"

    def updater() -> None:
        assert paused.wait(60)
        engine.update_weights_local([("lm_head.weight", new.lm_head.weight)])
        engine.resume(version=1)

    t = threading.Thread(target=updater)
    t.start()
    out = asyncio.run(ex.run_episodes([PromptSample(prompt)], 1))
    t.join(60)
    engine.close()
    [traj] = out.trajectories
    acts = [v for v, m in zip(traj.policy_versions, traj.action_mask) if m]
    k = split(acts)
    assert 0 < k < NEW and all(v == -1 for v, m in zip(traj.policy_versions, traj.action_mask) if not m)

    batch = pad_trajectories([traj], tok.pad_token_id or 0)
    with torch.no_grad():  # pi_old: the policy being trained, version 1
        batch.old_logprobs = token_logprobs(new, batch.input_ids, batch.attention_mask)
    pos = batch.loss_mask[0].nonzero().squeeze(1)
    log_w = (batch.old_logprobs - batch.rollout_logprobs)[0, pos]
    assert log_w[k:].abs().max() < 1e-4  # sampled by version 1: no correction
    assert log_w[:k].abs().max() > 0.1  # sampled by version 0: corrected by its own ratio
    for kind in ("tis", "icepop"):
        w, _ = is_correction_weights(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, kind, (0.5, 5.0))
        expect = log_w.exp()
        expect = expect.clamp(0.5, 5.0) if kind == "tis" else expect * ((expect >= 0.5) & (expect <= 5.0))
        torch.testing.assert_close(w[0, pos], expect, rtol=1e-5, atol=1e-6)
