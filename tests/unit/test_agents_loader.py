"""Agent files in OpenRLHF's format (the guide's, README's and skill guide's examples) with only the
import line changed, plus the examples/ agent files, run against a fake engine."""

from __future__ import annotations

import asyncio
import os
import random
import textwrap

import pytest

from rlhfkit.agents import AgentConfig, MultiTurnAgentExecutor, build_agent_executor, load_agent_file
from rlhfkit.models.tiny import build_tokenizer
from rlhfkit.types import Completion, PromptSample, SamplingParams

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
IMPORT = "from rlhfkit.agents import"  # replaces "from openrlhf.utils.agent import"


class ReplyEngine:
    """Replies `reply(prompt_text)` tokenized; logprob -0.5 per token."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.requests = tok, reply, []

    async def agenerate(self, req):
        self.requests.append(req)
        ids = self.tok(self.reply(self.tok.decode(req.prompt_token_ids)), add_special_tokens=False)["input_ids"]
        ids = ids[:req.params.max_new_tokens]
        return [Completion(list(req.prompt_token_ids), ids, [-0.5] * len(ids), "stop", req.request_id)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


CONFIG = AgentConfig(max_length=512, sampling_params=SamplingParams(max_new_tokens=16), step_timeout_s=5.0)

# The guide's "Minimal agent implementation", import line changed.
GUIDE_AGENT = f'''
from typing import Any, Dict
import torch

{IMPORT} AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        self.step_idx = 0
        return {{"observation": states["observation"]}}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.step_idx += 1
        done = self.step_idx >= 3
        reward = torch.tensor(1.0) if done else torch.tensor(0.0)
        environment_feedback = (
            "\\n\\nHuman: [CORRECT]\\n</s>"
            if done
            else "\\n\\nHuman: [INCORRECT]\\nPlease analyze the issues and try again.\\n</s>\\n\\nAssistant: "
        )
        return {{
            "rewards": reward,
            "scores": reward,
            "environment_feedback": environment_feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {{"step": self.step_idx}},
        }}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''

# The README's example: note its `async def __init__` and random episode length.
README_AGENT = f'''
import random
from typing import Any, Dict

import torch
{IMPORT} AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = random.randint(1, 3)

    async def reset(self, states: dict, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        observation_text = states["observation_text"]
        action_text = states["action_text"]
        label = states["label"]
        done = self.step_idx >= self.max_steps
        reward = torch.randint(0, 2, (1,)).float() if done else torch.tensor(0)
        environment_feedback = (
            "\\n\\nHuman: [CORRECT]\\n</s>"
            if done
            else "\\n\\nHuman: [INCORRECT]\\nPlease analyze the issues and try again.\\n</s>\\n\\nAssistant: "
        )
        self.step_idx += 1
        return {{
            "rewards": reward,
            "scores": reward,
            "environment_feedback": environment_feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {{"dummy_scores": reward}},
        }}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''

# The skill guide's older form: AgentExecutor(AgentExecutorBase) with constructor arguments and an
# execute(prompt, label, sampling_params) override that calls super().
SKILL_AGENT = f'''
{IMPORT} AgentExecutorBase, AgentInstanceBase
import torch

class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 2

    async def reset(self, states: dict, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states: dict, **kwargs):
        done = self.step_idx >= self.max_steps
        reward = float(states["action_text"] == states["label"]) if done else 0.0
        self.step_idx += 1
        return {{
            "rewards": torch.tensor([reward]),
            "scores": torch.tensor([reward]),
            "environment_feedback": "\\n\\n[EPISODE COMPLETE]\\n</s>" if done else "\\n\\nNext step:\\n</s>\\n\\nAssistant: ",
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {{"step": self.step_idx, "correct": reward == 1.0}},
        }}

class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

    async def execute(self, prompt, label, sampling_params):
        return await super().execute(prompt, label, sampling_params)
'''


def write(tmp_path, text, name="agent_func.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def episodes(path, engine, tok, samples, n=1, config=CONFIG):
    ex = build_agent_executor(path, engine, tok, config)
    return ex, asyncio.run(ex.run_episodes(samples, n_per_prompt=n))


def action_spans(mask):
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_guide_agent_runs_three_turns(tmp_path, tok):
    engine = ReplyEngine(tok, lambda p: "42</s>")
    _, batch = episodes(write(tmp_path, GUIDE_AGENT), engine, tok, [PromptSample(prompt="Human: 6*7?\n\nAssistant: ")])
    (t,) = batch.trajectories
    assert len(engine.requests) == 3 and t.reward == 1.0 and t.score == 1.0 and t.extra_logs == {"step": 3.0}
    assert len(action_spans(t.action_mask)) == 3
    # each next prompt extends the previous one by the action and the tokenized feedback
    fb = tok("\n\nHuman: [INCORRECT]\nPlease analyze the issues and try again.\n</s>\n\nAssistant: ",
             add_special_tokens=False)["input_ids"]
    r0, r1 = engine.requests[0].prompt_token_ids, engine.requests[1].prompt_token_ids
    assert r1 == r0 + tok("42</s>", add_special_tokens=False)["input_ids"] + fb
    last = tok("\n\nHuman: [CORRECT]\n</s>", add_special_tokens=False)["input_ids"]
    assert t.token_ids[-len(last):] == last and t.action_mask[-len(last):] == [0] * len(last)


def test_readme_agent_with_async_init(tmp_path, tok):
    random.seed(0)
    engine = ReplyEngine(tok, lambda p: "ok</s>")
    samples = [PromptSample(prompt=f"Q{i}: ", label="x") for i in range(4)]
    ex, batch = episodes(write(tmp_path, README_AGENT), engine, tok, samples, n=2)
    assert len(batch.trajectories) == 8 and batch.num_dropped == 0
    for t in batch.trajectories:
        steps = len(action_spans(t.action_mask))
        assert 2 <= steps <= 4  # max_steps in 1..3, done once step_idx >= max_steps
        assert t.reward in (0.0, 1.0) and t.extra_logs["dummy_scores"] == t.reward
    assert isinstance(ex, MultiTurnAgentExecutor) and ex.source_name.endswith("agent_func.py")


def test_skill_guide_executor_with_constructor_args(tmp_path, tok):
    engine = ReplyEngine(tok, lambda p: "7")
    _, batch = episodes(write(tmp_path, SKILL_AGENT), engine, tok,
                        [PromptSample(prompt="a", label="7"), PromptSample(prompt="b", label="8")])
    assert [t.reward for t in batch.trajectories] == [1.0, 0.0]
    assert all(len(action_spans(t.action_mask)) == 3 for t in batch.trajectories)
    assert batch.trajectories[0].extra_logs == {"step": 3.0, "correct": 1.0}


def test_instance_only_file_gets_multi_turn_executor(tmp_path, tok):
    text = GUIDE_AGENT.split("class AgentExecutor")[0]
    spec = load_agent_file(write(tmp_path, text))
    assert spec.executor_cls is None and spec.instance_cls.__name__ == "AgentInstance"
    engine = ReplyEngine(tok, lambda p: "1")
    _, batch = episodes(write(tmp_path, text, "b.py"), engine, tok, [PromptSample(prompt="p")])
    assert batch.trajectories[0].reward == 1.0


def test_unchanged_openrlhf_import_gets_a_hint(tmp_path):
    path = write(tmp_path, GUIDE_AGENT.replace(IMPORT, "from openrlhf.utils.agent import"))
    with pytest.raises(ImportError, match="replace `from openrlhf.utils.agent import ...` with `from rlhfkit.agents"):
        load_agent_file(path)


def test_file_errors(tmp_path):
    with pytest.raises(AttributeError, match="must define class AgentExecutor"):
        load_agent_file(write(tmp_path, "x = 1\n"))
    with pytest.raises(TypeError, match="AgentExecutor must be a class inheriting"):
        load_agent_file(write(tmp_path, "class AgentExecutor: pass\n", "c.py"))
    bad_init = f"{IMPORT} AgentExecutorBase\nclass AgentExecutor(AgentExecutorBase):\n" \
               "    def __init__(self, env_url): super().__init__()\n"
    with pytest.raises(TypeError, match="needs 'env_url'"):
        build_agent_executor(write(tmp_path, bad_init, "d.py"), None, None, CONFIG)


def test_example_agent_files(tok):
    label = "46"
    single = os.path.join(EXAMPLES, "agent_func.py")
    _, batch = episodes(single, ReplyEngine(tok, lambda p: "46</s>"), tok, [PromptSample(prompt="12+34=", label=label)])
    assert batch.trajectories[0].reward == 1.0 and len(action_spans(batch.trajectories[0].action_mask)) == 1

    # multi-turn: wrong, wrong, right -> reward 0.5**2, three actions, two feedback turns
    replies = iter(["40</s>", "50</s>", "46</s>"])
    engine = ReplyEngine(tok, lambda p: next(replies))
    multi = os.path.join(EXAMPLES, "agent_func_multiturn.py")
    _, batch = episodes(multi, engine, tok, [PromptSample(prompt="12+34=", label=label)])
    (t,) = batch.trajectories
    assert t.reward == 0.25 and t.score == 1.0 and t.extra_logs == {"attempts": 3.0, "correct": 1.0}
    assert len(action_spans(t.action_mask)) == 3 and not t.truncated
    assert "'40' is too low. Try again." in tok.decode(engine.requests[1].prompt_token_ids)
    assert "'50' is too high. Try again." in tok.decode(engine.requests[2].prompt_token_ids)


def test_executor_subclass_without_init_gets_the_instance_class(tmp_path, tok):
    text = GUIDE_AGENT.replace("    def __init__(self):\n        super().__init__(AgentInstance)\n", "    pass\n")
    assert "super().__init__(AgentInstance)" not in text
    _, batch = episodes(write(tmp_path, text), ReplyEngine(tok, lambda p: "1"), tok, [PromptSample(prompt="p")])
    assert batch.trajectories[0].reward == 1.0 and len(action_spans(batch.trajectories[0].action_mask)) == 3


CUSTOM_EXECUTE = f'''
{IMPORT} AgentExecutorBase

class AgentExecutor(AgentExecutorBase):
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        if label == "raise":
            raise KeyError("custom env failed")
        ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        act = hf_tokenizer("ab", add_special_tokens=False)["input_ids"]
        return {{"prompt": prompt, "label": label, "observation_tokens": ids + act + ids,
                "action_ranges": [(len(ids), len(ids) + len(act))], "rollout_log_probs": None,
                "reward": None if label == "none" else 0.5, "scores": None, "extra_logs": {{}}}}
'''


def test_custom_execute_returning_openrlhf_dict(tmp_path, tok):
    config = AgentConfig(max_length=64, sampling_params=SamplingParams(max_new_tokens=8), reward_failure="drop")
    samples = [PromptSample(prompt="12", label="x"), PromptSample(prompt="3", label="none"),
               PromptSample(prompt="4", label="raise")]
    _, batch = episodes(write(tmp_path, CUSTOM_EXECUTE), None, tok, samples, config=config)
    (t,) = batch.trajectories
    assert t.token_ids == [7, 8, 16, 17, 7, 8] and t.action_mask == [0, 0, 1, 1, 0, 0] and t.prompt_len == 2
    assert t.reward == 0.5 and t.score == 0.5 and t.rollout_logprobs == [0.0] * 6
    assert batch.num_dropped == 2 and "reward None" in batch.dropped[0].reason
    assert "execute() raised KeyError: 'custom env failed'" in batch.dropped[1].reason
