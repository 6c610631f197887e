"""Executors with a fake engine and the tiny character tokenizer: token layouts worked out by hand.

Char tokenizer ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, 4 <|im_start|>, 5 <|im_end|>, then '0'..'9' = 6..15.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlhfkit.agents import (AgentConfig, AgentInstanceBase, MultiTurnAgentExecutor, RewardFailure,
                            SingleTurnAgentExecutor)
from rlhfkit.models.tiny import build_tokenizer
from rlhfkit.rewards.sources import PythonRewardSource
from rlhfkit.types import Completion, PromptSample, SamplingParams


class FakeEngine:
    """`agenerate` replies `respond(prompt_ids)`, cut at max_new_tokens (then finish is "length");
    the i-th generated token gets logprob -(i + 1) / 10."""

    def __init__(self, respond):
        self.respond = respond
        self.requests = []
        self.expected = []  # expect_requests hints, with the requests already made when each came

    def expect_requests(self, n):
        self.expected.append((n, len(self.requests)))

    async def agenerate(self, req):
        self.requests.append(req)
        await asyncio.sleep(0)
        ids = list(self.respond(list(req.prompt_token_ids)))
        limit = req.params.max_new_tokens
        finish = "length" if len(ids) > limit else "stop"
        ids = ids[:limit]
        return [Completion(list(req.prompt_token_ids), ids, [-(i + 1) / 10 for i in range(len(ids))],
                           finish, req.request_id)]


def scripted(*replies):
    queue = [list(r) for r in replies]
    return FakeEngine(lambda prompt: queue.pop(0))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def config(**kw):
    base = dict(max_length=64, sampling_params=SamplingParams(max_new_tokens=8), step_timeout_s=5.0)
    base.update(kw)
    return AgentConfig(**base)


def run(coro):
    return asyncio.run(coro)


class ScriptedAgent(AgentInstanceBase):
    """Step k returns STEPS[k] (feedback, reward, done, scores) and records the states it saw."""

    STEPS: list = []
    seen: list = []

    async def step(self, states, **kwargs):
        k = sum(1 for s in ScriptedAgent.seen if s is not None and s.get("_id") == id(self))
        ScriptedAgent.seen.append({**states, "_id": id(self)})
        feedback, reward, done, scores = ScriptedAgent.STEPS[k]
        out = {"rewards": torch.tensor(reward), "environment_feedback": feedback, "done": done,
               "extra_logs": {"k": k}}
        if scores is not None:
            out["scores"] = torch.tensor([scores])
        return out


def multi_turn(engine, tok, steps, **kw):
    ScriptedAgent.STEPS, ScriptedAgent.seen = steps, []
    return MultiTurnAgentExecutor(ScriptedAgent).setup(engine, tok, config(**kw))


def test_char_ids(tok):
    assert tok("12", add_special_tokens=False)["input_ids"] == [7, 8]
    assert tok("3</s>", add_special_tokens=False)["input_ids"] == [9, 2]


def test_multi_turn_layout_by_hand(tok):
    # prompt "12" -> [7, 8]; action 1 = "3</s>" [9, 2]; feedback "45" [10, 11]; action 2 = "6" [12];
    # final feedback "7" [13]. Reward = 0.5 + 1.0 (sum); score = last step's scores (0.25).
    engine = scripted([9, 2], [12])
    ex = multi_turn(engine, tok, [("45", 0.5, False, None), ("7", 1.0, True, 0.25)])
    batch = run(ex.run_episodes([PromptSample(prompt="12", label="L")]))
    (t,) = batch.trajectories
    assert t.token_ids == [7, 8, 9, 2, 10, 11, 12, 13]
    assert t.action_mask == [0, 0, 1, 1, 0, 0, 1, 0]
    assert t.rollout_logprobs == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.1, 0])
    assert t.prompt_len == 2 and t.reward == pytest.approx(1.5) and t.score == pytest.approx(0.25)
    assert not t.truncated and t.extra_logs == {"k": 1.0} and t.label == "L" and t.prompt == "12"
    # token in, token out: turn 2's prompt is turn 1's ids + action + feedback, exactly
    assert [r.prompt_token_ids for r in engine.requests] == [[7, 8], [7, 8, 9, 2, 10, 11]]
    # what step() saw: decoded action without special tokens, the text context before the action
    s1, s2 = ScriptedAgent.seen
    assert (s1["observation_text"], s1["action_text"], s1["label"]) == ("12", "3", "L")
    assert (s2["observation_text"], s2["action_text"]) == ("12345", "6")
    assert isinstance(s1["sampling_params"], SamplingParams)


def test_transcript_is_never_retokenized(tok):
    # The action is the three character tokens '<', 's', '>'; decoding and re-encoding the text
    # would give the single special token <s> (id 1). The next prompt must keep the 3 ids.
    chars = tok.convert_tokens_to_ids(["<", "s", ">"])
    assert tok(tok.decode(chars), add_special_tokens=False)["input_ids"] == [1]
    engine = scripted(chars, [12])
    ex = multi_turn(engine, tok, [("", 0.0, False, None), ("", 1.0, True, None)])
    (t,) = run(ex.run_episodes([PromptSample(prompt="12")])).trajectories
    assert engine.requests[1].prompt_token_ids == [7, 8] + chars
    assert t.token_ids == [7, 8] + chars + [12] and t.action_mask == [0, 0, 1, 1, 1, 1]
    assert t.score == t.reward == 1.0  # no "scores" given: the running reward sum


def test_budget_cuts_actions_and_feedback(tok):
    # max_length 10, prompt 2, max_new 4: action 1 = 4 of 6 tokens (length), feedback 3 -> 9 tokens;
    # action 2 gets a budget of 1 token; its feedback is cut to 0 tokens; not done -> truncated.
    engine = FakeEngine(lambda p: [12, 13, 14, 15, 6, 7])
    ex = multi_turn(engine, tok, [("abc", 0.0, False, None), ("xyz", 0.5, False, None)],
                    max_length=10, sampling_params=SamplingParams(max_new_tokens=4))
    (t,) = run(ex.run_episodes([PromptSample(prompt="12")])).trajectories
    assert [r.params.max_new_tokens for r in engine.requests] == [4, 1]
    assert t.token_ids == [7, 8, 12, 13, 14, 15] + tok("abc", add_special_tokens=False)["input_ids"] + [12]
    assert t.action_mask == [0, 0, 1, 1, 1, 1, 0, 0, 0, 1]
    assert t.truncated and t.reward == 0.5 and len(t.rollout_logprobs) == 10


def test_long_prompt_left_truncated(tok):
    engine = FakeEngine(lambda p: [2])
    ex = multi_turn(engine, tok, [("", 1.0, True, None)], max_length=10,
                    sampling_params=SamplingParams(max_new_tokens=4))
    (t,) = run(ex.run_episodes([PromptSample(prompt="12345678")])).trajectories
    assert t.token_ids[:t.prompt_len] == [9, 10, 11, 12, 13, 14]  # "345678", the last 6 of "12345678"


def test_step_sampling_params_override(tok):
    class Agent(AgentInstanceBase):
        async def step(self, states, **kw):
            return {"rewards": 0.0, "environment_feedback": "", "done": states["sampling_params"].temperature == 0.5,
                    "sampling_params": {"temperature": 0.5, "max_tokens": 2}}

    engine = FakeEngine(lambda p: [6, 6, 6])
    ex = MultiTurnAgentExecutor(Agent).setup(engine, tok, config())
    (t,) = run(ex.run_episodes([PromptSample(prompt="1")])).trajectories
    p1, p2 = (r.params for r in engine.requests)
    assert (p1.temperature, p1.max_new_tokens) == (1.0, 8) and (p2.temperature, p2.max_new_tokens) == (0.5, 2)
    assert sum(t.action_mask) == 5 and t.truncated  # the last action stopped by length


class Failing(AgentInstanceBase):
    async def step(self, states, **kw):
        if states["label"] == "bad":
            raise ValueError("env exploded")
        return {"rewards": 1.0, "environment_feedback": "", "done": True}


def test_step_error_stop_raises_with_prompt(tok):
    ex = MultiTurnAgentExecutor(Failing).setup(FakeEngine(lambda p: [6]), tok, config(), source_name="env.py")
    samples = [PromptSample(prompt="ok", label="good"), PromptSample(prompt="the bad prompt", label="bad")]
    with pytest.raises(RewardFailure) as e:
        run(ex.run_episodes(samples, n_per_prompt=2))
    assert "env exploded" in str(e.value) and "the bad prompt" in str(e.value) and "env.py" in str(e.value)
    assert e.value.prompt == "the bad prompt"


def test_step_error_drop_counts(tok):
    ex = MultiTurnAgentExecutor(Failing).setup(FakeEngine(lambda p: [6]), tok, config(reward_failure="drop"))
    samples = [PromptSample(prompt="a", label="good"), PromptSample(prompt="b", label="bad"),
               PromptSample(prompt="c", label="good")]
    batch = run(ex.run_episodes(samples, n_per_prompt=2))
    assert [t.group_index for t in batch.trajectories] == [0, 0, 2, 2]
    assert all(t.reward == 1.0 for t in batch.trajectories)
    assert batch.num_dropped == 2 and {d.prompt for d in batch.dropped} == {"b"}
    assert "env exploded" in batch.dropped[0].reason and ex.num_dropped == 2


def test_step_timeout(tok):
    class Slow(AgentInstanceBase):
        async def step(self, states, **kw):
            await asyncio.sleep(30)

    ex = MultiTurnAgentExecutor(Slow).setup(FakeEngine(lambda p: [6]), tok, config(step_timeout_s=0.05))
    with pytest.raises(RewardFailure, match="did not return within 0.05 s"):
        run(ex.run_episodes([PromptSample(prompt="p")]))


@pytest.mark.parametrize("bad, msg", [
    ({"rewards": 1.0, "done": True}, "lacks \\['environment_feedback'\\]"),
    ({"rewards": torch.ones(2), "environment_feedback": "", "done": True}, "shape \\(2,\\)"),
    ({"rewards": 1.0, "environment_feedback": 3, "done": True}, "must be a str"),
    ({"rewards": float("nan"), "environment_feedback": "", "done": True}, "must be finite"),
    ({"rewards": 1.0, "environment_feedback": "", "done": "yes"}, "done must be a bool"),
    ([1.0], "must return a dict"),
])
def test_step_result_validation(tok, bad, msg):
    class Bad(AgentInstanceBase):
        async def step(self, states, **kw):
            return bad

    ex = MultiTurnAgentExecutor(Bad).setup(FakeEngine(lambda p: [6]), tok, config(), source_name="my_agent.py")
    with pytest.raises(RewardFailure, match=msg) as e:
        run(ex.run_episodes([PromptSample(prompt="p")]))
    assert "my_agent.py" in str(e.value)


def test_reset_can_change_observation(tok):
    class Agent(AgentInstanceBase):
        async def reset(self, states, **kw):
            return {"observation": states["observation"] + "9"}

        async def step(self, states, **kw):
            return {"rewards": 0.0, "environment_feedback": "", "done": True}

    engine = FakeEngine(lambda p: [6])
    ex = MultiTurnAgentExecutor(Agent).setup(engine, tok, config())
    (t,) = run(ex.run_episodes([PromptSample(prompt="1")])).trajectories
    assert engine.requests[0].prompt_token_ids == [7, 15] and t.prompt_len == 2


# ----------------------------------------------------------------------------- single-turn


def exact_match(queries, prompts, labels):
    """Reward 1 when the response (query minus prompt, up to </s>) equals the label."""
    r = [float(q[len(p):].split("</s>")[0] == lab) for q, p, lab in zip(queries, prompts, labels)]
    return {"rewards": torch.tensor(r), "scores": torch.tensor(r) / 2, "extra_logs": {"n": len(queries)}}


def echo_sum_engine(tok):
    """Replies the digit sum of the prompt "a+b=" then </s> (deterministic, content-based)."""
    def respond(prompt):
        a, b = tok.decode(prompt).rstrip("=").split("+")
        return tok(str(int(a) + int(b)) + "</s>", add_special_tokens=False)["input_ids"]
    return FakeEngine(respond)


def test_single_turn_rewards_groups_and_seeds(tok):
    engine = echo_sum_engine(tok)
    ex = SingleTurnAgentExecutor(reward_source=PythonRewardSource(exact_match, name="rf.py"))
    ex.setup(engine, tok, config(sampling_params=SamplingParams(max_new_tokens=8, seed=7), reward_batch_size=4))
    samples = [PromptSample(prompt="1+2=", label="3"), PromptSample(prompt="2+2=", label="5")]
    batch = run(ex.run_episodes(samples, n_per_prompt=3))
    ts = batch.trajectories
    assert [t.group_index for t in ts] == [0, 0, 0, 1, 1, 1]
    assert [t.reward for t in ts] == [1, 1, 1, 0, 0, 0] and [t.score for t in ts] == [0.5] * 3 + [0] * 3
    t = ts[0]
    assert t.token_ids == tok("1+2=3</s>", add_special_tokens=False)["input_ids"]
    assert t.action_mask == [0, 0, 0, 0, 1, 1] and t.prompt_len == 4 and t.response == "3"
    assert t.rollout_logprobs == pytest.approx([0, 0, 0, 0, -0.1, -0.2])
    assert sorted(r.params.seed for r in engine.requests) == list(range(7, 13))  # distinct per episode
    assert engine.expected == [(6, 0)]  # the engine heard of the 6 first turns before any came
    # 6 concurrent reward calls merged into batches of at most 4: the logged batch sizes say so
    assert sorted(t.extra_logs["n"] for t in ts) == [2, 2, 4, 4, 4, 4]
    assert ex.scores_rewards


def raising_reward(queries, prompts, labels):
    if any("bad" in p for p in prompts):
        raise KeyError("no verifier for this one")
    return [1.0] * len(queries)


def test_single_turn_reward_failure_stop(tok):
    ex = SingleTurnAgentExecutor(reward_source=PythonRewardSource(raising_reward, name="rf.py"))
    ex.setup(FakeEngine(lambda p: [6]), tok, config(reward_batch_size=1))
    with pytest.raises(RewardFailure) as e:
        run(ex.run_episodes([PromptSample(prompt="good"), PromptSample(prompt="bad one")]))
    assert "no verifier for this one" in str(e.value) and "'bad one'" in str(e.value)
    assert "rf.py" in str(e.value)


def test_single_turn_reward_failure_drop_counts(tok):
    ex = SingleTurnAgentExecutor(reward_source=PythonRewardSource(raising_reward, name="rf.py"))
    ex.setup(FakeEngine(lambda p: [6]), tok, config(reward_batch_size=1, reward_failure="drop"))
    batch = run(ex.run_episodes([PromptSample(prompt="good"), PromptSample(prompt="bad one")], n_per_prompt=2))
    assert len(batch.trajectories) == 2 and all(t.reward == 1.0 for t in batch.trajectories)
    assert batch.num_dropped == 2 and all(d.group_index == 1 for d in batch.dropped)


def test_single_turn_without_reward_source(tok):
    ex = SingleTurnAgentExecutor().setup(FakeEngine(lambda p: [6, 7, 8]), tok,
                                         config(sampling_params=SamplingParams(max_new_tokens=2)))
    (t,) = run(ex.run_episodes([PromptSample(prompt="1")])).trajectories
    assert not ex.scores_rewards and t.truncated and t.token_ids == [7, 6, 7]


def test_config_errors():
    with pytest.raises(ValueError, match="--reward_failure"):
        AgentConfig(reward_failure="ignore")
    with pytest.raises(ValueError, match="--generate_max_len"):
        AgentConfig(max_length=8, sampling_params=SamplingParams(max_new_tokens=9))


def test_max_new_tokens_equal_to_max_length_generates_what_the_budget_leaves(tok):
    """max_new_tokens == max_length (OpenRLHF's unset --rollout.max_new_tokens): the prompt is kept and the
    generation gets max_length - prompt tokens."""
    ex = SingleTurnAgentExecutor().setup(FakeEngine(lambda p: [6] * 50), tok,
                                         config(max_length=8, sampling_params=SamplingParams(max_new_tokens=8)))
    (t,) = run(ex.run_episodes([PromptSample(prompt="123")])).trajectories
    assert t.prompt_len == 3 and len(t.token_ids) == 8 and t.truncated
