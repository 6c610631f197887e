"""examples/agent_func_gem.py (OpenRLHF's GEM agent shape: async __init__, gem.make, env.reset(seed)
-> (text, info), env.step(action) -> 5-tuple) with a small fake ``gem`` module, and with the real
gem-llm package where it is installed (GuessTheNumber played by binary search)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import sys
import types

import pytest

from rlhfkit.agents import AgentConfig, MultiTurnAgentExecutor, build_agent_executor
from rlhfkit.models.tiny import build_tokenizer
from rlhfkit.types import Completion, PromptSample, SamplingParams

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent_func_gem.py")
CONFIG = AgentConfig(max_length=1024, sampling_params=SamplingParams(max_new_tokens=12), step_timeout_s=30.0)


class FakeGuessEnv:
    """The API the file uses. Target = the reset seed; a wrong guess earns -0.25 and says
    higher/lower; an unreadable one earns -5 and ends the game; max_turns guesses in all."""

    def __init__(self, env_id, **kwargs):
        self.env_id, self.max_turns, self.target, self.turn = env_id, 3, None, 0

    def reset(self, seed=None):
        self.target, self.turn = seed, 0
        return "Guess my number in \\boxed{}.", {"suffix": ""}

    def step(self, action):
        self.turn += 1
        m = re.findall(r"\\boxed\{(\d+)\}", action)
        if not m:
            return "bad format", -5.0, True, False, {}
        guess = int(m[-1])
        if guess == self.target:
            return "correct!", 1.0, True, False, {}
        return f"{'higher' if guess < self.target else 'lower'} than {guess}", -0.25, False, \
            self.turn >= self.max_turns, {}


class Replies:
    """A fake engine replying `reply(prompt text)`; logprob -0.5 per token."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.prompts = tok, reply, []

    async def agenerate(self, req):
        text = self.tok.decode(req.prompt_token_ids)
        self.prompts.append(text)
        ids = self.tok(self.reply(text), add_special_tokens=False)["input_ids"][:req.params.max_new_tokens]
        return [Completion(list(req.prompt_token_ids), ids, [-0.5] * len(ids), "stop", req.request_id)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def play(tok, reply, label):
    engine = Replies(tok, reply)
    ex = build_agent_executor(EXAMPLE, engine, tok, CONFIG)
    assert isinstance(ex, MultiTurnAgentExecutor)
    (t,) = asyncio.run(ex.run_episodes([PromptSample(prompt="ignored", label=label)])).trajectories
    return t, engine


def spans(mask):
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def test_gem_file_with_a_fake_gem_module(tok, monkeypatch):
    fake = types.ModuleType("gem")
    made = []
    fake.make = lambda env_id, **kw: made.append(FakeGuessEnv(env_id, **kw)) or made[-1]
    monkeypatch.setitem(sys.modules, "gem", fake)

    guesses = iter(["\\boxed{3}</s>", "\\boxed{9}</s>", "\\boxed{7}</s>"])
    t, engine = play(tok, lambda text: next(guesses), "7")
    assert made[0].env_id == "game:GuessTheNumber-v0-easy" and made[0].target == 7
    assert t.reward == pytest.approx(-0.25 - 0.25 + 1.0) and t.score == 1.0 and not t.truncated
    assert t.extra_logs == {"turn_count": 3.0} and spans(t.action_mask) == 3
    text = tok.decode(t.token_ids)
    assert text.startswith("<|im_start|>user\nGuess my number in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>user\nhigher than 3<|im_end|>" in engine.prompts[1]
    assert "<|im_start|>user\nlower than 9<|im_end|>" in engine.prompts[2]
    assert text.endswith("\\boxed{7}</s><|im_end|>\n<|im_start|>user\ncorrect!<|im_end|>\n")
    feedback = [tok_id for tok_id, m in zip(t.token_ids[t.prompt_len:], t.action_mask[t.prompt_len:]) if not m]
    assert "correct!" in tok.decode(feedback) and "higher than 3" in tok.decode(feedback)  # masked out

    t, _ = play(tok, lambda text: "no idea", "7")  # an unreadable action ends the game; reward floor -1
    assert t.reward == -1.0 and spans(t.action_mask) == 1


@pytest.mark.skipif(importlib.util.find_spec("gem") is None, reason="gem-llm is not installed")
def test_gem_file_with_the_real_gem_package(tok):
    import gem  # noqa: F401 - the real package

    def binary_search(text):
        lo, hi = 1, 10  # GuessTheNumber-v0-easy: 1..10 in 4 turns
        for guess, hint in re.findall(r"you guessed (\d+), and the target number is (higher|lower)", text):
            if hint == "higher":
                lo = max(lo, int(guess) + 1)
            else:
                hi = min(hi, int(guess) - 1)
        return f"\\boxed{{{(lo + hi) // 2}}}</s>"

    t, engine = play(tok, binary_search, "1234")
    assert "Guess The Number" in engine.prompts[0]
    assert t.reward == 1.0 and t.score == 1.0 and not t.truncated  # hints are worth 0, the win 1
    assert "Congratulations! You guessed the correct number" in tok.decode(t.token_ids)
    assert 1 <= t.extra_logs["turn_count"] <= 4 and spans(t.action_mask) == t.extra_logs["turn_count"]
