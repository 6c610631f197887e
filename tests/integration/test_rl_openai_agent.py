"""examples/agent_func_openai.py (an AsyncOpenAI multi-turn agent) on the tiny model's builtin
engine: the token ids and log-probs it trains on are the engine's, and it drives train_ppo."""

from __future__ import annotations

from functools import wraps

import asyncio
import json
import os

import pytest
from helpers import ppo_flags
import torch

from rlhfkit.agents import AgentConfig, OpenAIAgentExecutor, build_agent_executor
from rlhfkit.cli import train_ppo
from rlhfkit.roles.actor import ActorRole
from rlhfkit.types import PromptSample, SamplingParams

pytest.importorskip("openai")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT_FILE = os.path.join(ROOT, "examples", "agent_func_openai.py")


class SpyEngine:
    """Passes requests to the real engine and keeps each (request, completion) pair."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def agenerate(self, request):
        outs = await self.engine.agenerate(request)
        self.calls.append((request, outs[0]))
        return outs


def action_spans(mask):
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_recorded_tokens_are_the_engines(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.rollout.builtin import BuiltinEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = BuiltinEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok, device="cpu")
    spy = SpyEngine(engine)
    cfg = AgentConfig(max_length=160, sampling_params=SamplingParams(max_new_tokens=6, seed=5), step_timeout_s=60)
    ex = build_agent_executor(AGENT_FILE, spy, tok, cfg)
    assert isinstance(ex, OpenAIAgentExecutor)
    samples = [PromptSample(prompt="12+34=", label="46"), PromptSample(prompt="5+5=", label="10")]
    trajs = asyncio.run(ex.run_episodes(samples, 2)).trajectories
    assert len(trajs) == 4 and len(spy.calls) >= 4

    used = set()
    for t in trajs:
        spans = action_spans(t.action_mask)
        assert len(spans) == int(t.extra_logs["openai_turns"]) and t.extra_logs["openai_segments"] == 1.0
        for s, e in spans:  # every trained span is one engine completion, token for token
            k = next(i for i, (req, c) in enumerate(spy.calls)
                     if i not in used and c.prompt_token_ids == t.token_ids[:s] and c.token_ids == t.token_ids[s:e])
            used.add(k)
            assert t.rollout_logprobs[s:e] == spy.calls[k][1].logprobs
        assert not any(t.rollout_logprobs[i] for i, m in enumerate(t.action_mask) if not m)
    assert used == set(range(len(spy.calls)))  # and every completion is in a trajectory
    assert any(len(action_spans(t.action_mask)) == 2 for t in trajs), "no second turn: nothing shown about turns"

    # the same requests again, straight to the engine (same prompt ids, same seeds): the same tokens
    again = engine.generate([req for req, _ in spy.calls])
    for (req, c), [d] in zip(spy.calls, again):
        assert d.token_ids == c.token_ids and d.prompt_token_ids == req.prompt_token_ids
        torch.testing.assert_close(torch.tensor(d.logprobs), torch.tensor(c.logprobs), atol=1e-5, rtol=0)
    engine.close()


def test_openai_agent_drives_train_ppo(tiny_model_dir, tmp_path, monkeypatch):
    rows = [{"input": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (2, 2), (5, 1))]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen, made = [], []
    real_train, real_traj = ActorRole.train_on, OpenAIAgentExecutor._trajectory
    monkeypatch.setattr(ActorRole, "train_on",
                        wraps(real_train)(lambda self, b, kl=0.0: seen.append(b.to("cpu")) or real_train(self, b, kl)))
    monkeypatch.setattr(OpenAIAgentExecutor, "_trajectory",
                        lambda self, s, r: made.append(real_traj(self, s, r)) or made[-1])
    train_ppo.main(ppo_flags(tiny_model_dir, str(prompts), str(tmp_path / "out"), "--agent_func_path", AGENT_FILE,
                             label_key="answer", advantage_estimator="reinforce_baseline", rollout_batch_size=2,
                             train_batch_size=4, max_len=128, max_steps=2, init_kl_coef="0.01", use_kl_loss=True))

    assert len(seen) == 2 and len(made) == 8
    by_ids = {tuple(t.token_ids): t for t in made}
    feedback_rows = 0
    for batch in seen:  # each row trained on is a recorded trajectory; loss only on generated tokens
        for i in range(batch.batch_size):
            n = int(batch.attention_mask[i].sum())
            t = by_ids[tuple(batch.input_ids[i, :n].tolist())]
            assert batch.loss_mask[i, :n].tolist() == [0] + t.action_mask[1:]
            assert not batch.loss_mask[i, n:].any()
            spans = action_spans(t.action_mask)
            feedback_rows += len(spans) > 1
            assert float(batch.rewards[i]) == t.reward
    assert feedback_rows > 0, "no episode had a second turn: the masking of feedback was not shown"
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 2]
    assert all("train/attempts" in r and "train/openai_turns" in r for r in recs)
