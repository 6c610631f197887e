"""User code failing one sample at a time: blocking code ended by the time limit, sys.exit() and
KeyboardInterrupt reported as failures of that sample, batched reward calls retried per sample."""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time

import pytest

from rlhfkit.agents import (AgentConfig, AgentInstanceBase, EpisodeError, MultiTurnAgentExecutor, RewardFailure,
                            SingleTurnAgentExecutor)
from rlhfkit.models.tiny import build_tokenizer
from rlhfkit.rewards import PythonRewardSource
from rlhfkit.usercode.run import UserLoop, run_user_code, shutdown_user_threads
from rlhfkit.types import Completion, PromptSample, SamplingParams


class EchoEngine:
    """Replies the token of '7' to every request."""

    async def agenerate(self, req):
        await asyncio.sleep(0)
        return [Completion(list(req.prompt_token_ids), [13], [-0.5], "stop", req.request_id)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def config(**kw):
    base = dict(max_length=64, sampling_params=SamplingParams(max_new_tokens=4), step_timeout_s=5.0,
                reward_timeout_s=5.0)
    base.update(kw)
    return AgentConfig(**base)


def write(tmp_path, body: str, name: str = "rf.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def score(source, queries, prompts=None):
    return asyncio.run(source(queries, prompts or [""] * len(queries), [None] * len(queries)))


# ----------------------------------------------------------------------------- time limits


def test_blocking_async_reward_func_is_ended_by_the_time_limit(tmp_path):
    path = write(tmp_path, """
        import time
        async def reward_func(queries, prompts, labels):
            time.sleep(5)          # blocks its event loop: never awaits
            return [1.0] * len(queries)
    """)
    t0 = time.perf_counter()
    with pytest.raises(EpisodeError, match=r"reward_func did not return within 0.3 s \(--reward_timeout\)") as e:
        score(PythonRewardSource(path, timeout_s=0.3), ["a"])
    assert path in str(e.value) and time.perf_counter() - t0 < 2.0


def test_blocking_agent_step_fails_only_its_episode(tok):
    class Env(AgentInstanceBase):
        async def step(self, states, **kw):
            if states["label"] == "slow":
                time.sleep(3)      # blocks: must not hold up the other episodes
            return {"rewards": 1.0, "environment_feedback": "", "done": True}

    ex = MultiTurnAgentExecutor(Env).setup(EchoEngine(), tok, config(step_timeout_s=0.5, reward_failure="drop"))
    samples = [PromptSample(prompt=p, label=lab) for p, lab in [("1", "ok"), ("2", "slow"), ("3", "ok")]]
    t0 = time.perf_counter()
    batch = asyncio.run(ex.run_episodes(samples, n_per_prompt=2))
    assert time.perf_counter() - t0 < 2.5
    assert [t.group_index for t in batch.trajectories] == [0, 0, 2, 2]
    assert [d.group_index for d in batch.dropped] == [1, 1]
    assert all("step() did not return within 0.5 s" in d.reason for d in batch.dropped)


# ----------------------------------------------------------------------------- SystemExit / KeyboardInterrupt


@pytest.mark.parametrize("kind", ["def", "async def"])
@pytest.mark.parametrize("raise_", ["sys.exit(3)", "raise KeyboardInterrupt"])
def test_exit_in_reward_func_is_a_failure_of_the_sample(tmp_path, kind, raise_):
    path = write(tmp_path, f"""
        import sys
        {kind} reward_func(queries, prompts, labels):
            {raise_}
    """)
    name = "SystemExit: 3" if "exit" in raise_ else "KeyboardInterrupt"
    with pytest.raises(EpisodeError, match=f"reward_func raised {name}") as e:
        score(PythonRewardSource(path), ["a"])
    assert path in str(e.value)


def test_exit_in_agent_step_drops_only_that_sample(tok):
    class Env(AgentInstanceBase):
        async def step(self, states, **kw):
            if states["label"] == "bad":
                raise SystemExit("bye")
            return {"rewards": 2.0, "environment_feedback": "", "done": True}

    ex = MultiTurnAgentExecutor(Env).setup(EchoEngine(), tok, config(reward_failure="drop"), source_name="env.py")
    batch = asyncio.run(ex.run_episodes([PromptSample(prompt="1", label="bad"), PromptSample(prompt="2")]))
    assert [t.reward for t in batch.trajectories] == [2.0]
    assert batch.num_dropped == 1 and "step() raised SystemExit: bye" in batch.dropped[0].reason


def test_cancelled_error_raised_by_user_code_is_a_failure():
    async def cancel_itself():
        raise asyncio.CancelledError()

    with pytest.raises(EpisodeError, match="raised asyncio.CancelledError"):
        asyncio.run(run_user_code(cancel_itself, what="f()", timeout_s=1.0))


# ----------------------------------------------------------------------------- per-sample retry of batches

RAISE_ON_X = '''
def reward_func(queries, prompts, labels):
    bad = [p for p in prompts if "x" in p]
    if bad:
        raise ValueError("no verifier for " + repr(bad[0]))
    return [float(len(q)) for q in queries]
'''


def test_batched_drop_keeps_the_samples_that_score(tmp_path, tok):
    path = write(tmp_path, RAISE_ON_X)
    ex = SingleTurnAgentExecutor(reward_source=PythonRewardSource(path))
    ex.setup(EchoEngine(), tok, config(reward_batch_size=64, reward_failure="drop"))
    prompts = ["12", "3x4", "56", "x"]
    batch = asyncio.run(ex.run_episodes([PromptSample(prompt=p) for p in prompts], n_per_prompt=2))
    assert ex.reward_source.num_retried_batches == 1  # one batch of 8, then 8 calls of one
    assert [d.prompt for d in batch.dropped] == ["3x4", "3x4", "x", "x"]
    # the survivors' rewards are those of the reward function: len(prompt + "7")
    assert [(t.prompt, t.reward) for t in batch.trajectories] == [("12", 3.0), ("12", 3.0), ("56", 3.0), ("56", 3.0)]


def test_batched_stop_quotes_the_failing_sample(tmp_path, tok):
    path = write(tmp_path, RAISE_ON_X)
    ex = SingleTurnAgentExecutor(reward_source=PythonRewardSource(path))
    ex.setup(EchoEngine(), tok, config(reward_batch_size=64))
    samples = [PromptSample(prompt=p) for p in ["11", "22", "33", "4x4", "55"]]
    with pytest.raises(RewardFailure) as e:
        asyncio.run(ex.run_episodes(samples))
    assert e.value.prompt == "4x4"
    line = str(e.value)
    assert "\n" not in line and path in line and "ValueError: no verifier for '4x4'" in line
    assert "sample prompt: '4x4'" in line


def test_reward_failure_is_one_line_with_a_truncated_prompt():
    e = RewardFailure("rf.py: reward_func raised ValueError: line one\nline two", "p" * 1000, "rf.py")
    text = str(e)
    assert "\n" not in text and "line one | line two" in text
    assert "'" + "p" * RewardFailure.PROMPT_CHARS + "...'" in text and e.prompt == "p" * 1000


# ----------------------------------------------------------------------------- threads


def test_shutdown_user_threads_stops_idle_loops_and_reports_stuck_ones():
    release = threading.Event()
    idle, stuck = UserLoop("idle"), UserLoop("stuck")
    assert idle.submit(lambda: 1).result(timeout=5) == 1
    started = threading.Event()

    def block():
        started.set()
        release.wait()

    stuck.submit(block)
    # once inside the user code (a stop queued before the call starts would cancel it instead)
    assert started.wait(5)
    assert shutdown_user_threads(timeout_s=0.3) >= 1  # the stuck one is still inside user code
    assert idle.join(1.0)
    release.set()
    assert stuck.join(5.0)  # it ends once the user code returns
