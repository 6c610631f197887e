"""Agent API (OpenRLHF-compatible): AgentInstanceBase, AgentExecutorBase, and the checks on user output.

A user file (``--agent_func_path``) defines an environment as an ``AgentInstance(AgentInstanceBase)``
and usually wraps it in ``AgentExecutor(MultiTurnAgentExecutor)``; see ``examples/agent_func*.py``.
Executors run episodes token in, token out against a ``RolloutEngine``:

    PromptSample --execute()--> Trajectory (or OpenRLHF's dict, converted and checked here)
    run_episodes(samples, n) --> EpisodeBatch(trajectories, dropped)

User code is called through ``call_user``: in a worker thread with its own event loop (one per
episode, see ``usercode/run.py``), under a time limit that ends even a call that blocks; any exception
(``SystemExit`` and ``KeyboardInterrupt`` included) becomes an ``EpisodeError`` of that sample.
``AgentConfig.reward_failure`` decides what an ``EpisodeError`` does: ``stop`` raises
``RewardFailure`` (one line naming the file, the failing sample's prompt and the error);
``drop`` leaves the sample out and records it in ``EpisodeBatch.dropped`` (and
``executor.num_dropped``). No failure ever turns into a zero reward. Engine errors are not
user failures and propagate as they are; any exception of a user-written ``execute()`` counts
as a user failure.

``states`` handed to user code (key names as in OpenRLHF):
    reset: {"observation": prompt text, "label": label}  ->  {"observation": str}
    step:  {"observation_text": context before the action, "action_text": decoded action,
            "label": label, "sampling_params": SamplingParams}
           ->  {"rewards", "scores"?, "environment_feedback", "done", "sampling_params"?, "extra_logs"?}
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from abc import ABC
from typing import Any, Sequence

from rlhfkit.agents.contracts import (  # noqa: F401 - re-exported: where agent files import the API from
    FAILURE_POLICIES,
    AgentConfig,
    AgentInstanceBase,
    DroppedEpisode,
    EpisodeBatch,
    RewardFailure,
    StepResult,
    call_user,
    check_reset_result,
    check_step_result,
    coerce_sampling_params,
    create_agent_instance,
    to_bool,
    to_float,
    to_float_logs,
    trajectory_from_dict,
)
from rlhfkit.agents.episode import run_multi_turn
from rlhfkit.usercode.run import EpisodeError
from rlhfkit.types import PromptSample, SamplingParams, Trajectory

logger = logging.getLogger(__name__)


class AgentExecutorBase(ABC):
    """Runs episodes token in, token out. Subclasses implement ``execute``; with an
    ``agent_instance_cls`` the default ``execute`` is the multi-turn loop.

    Constructor arguments follow OpenRLHF (``AgentInstance, max_steps, max_length, llm_engine,
    hf_tokenizer, result_queue``; all optional). ``setup()`` binds the engine, tokenizer and
    ``AgentConfig`` before ``run_episodes``.
    """

    def __init__(self, agent_instance_cls: type | None = None, max_steps: int | None = None,
                 max_length: int | None = None, llm_engine: Any = None, hf_tokenizer: Any = None,
                 result_queue: Any = None, **kwargs: Any) -> None:
        if agent_instance_cls is not None and not (
                isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"{agent_instance_cls!r} must be a class inheriting rlhfkit.agents.AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls
        self.max_steps = max_steps
        self.max_length = max_length
        self.llm_engine = llm_engine
        self.hf_tokenizer = hf_tokenizer

    def setup(self, engine: Any, tokenizer: Any, config: AgentConfig, reward_source: Any = None,
              source_name: str | None = None) -> "AgentExecutorBase":
        """Bind the engine (``RolloutEngine``), tokenizer and settings; returns self."""
        self.llm_engine, self.hf_tokenizer, self.config = engine, tokenizer, config
        self.max_length = config.max_length
        self.reward_source = reward_source
        self.source_name = source_name or getattr(self, "source_name", None) or type(self).__qualname__
        self.num_dropped = getattr(self, "num_dropped", 0)
        self._request_ids = itertools.count()
        self._episode_ids = itertools.count()
        # exceptions of a user-written execute() fall under --reward_failure; ours raise EpisodeError
        self._user_execute = not type(self).execute.__module__.startswith("rlhfkit.")
        params = inspect.signature(self.execute).parameters.values()
        self._execute_params = {p.name for p in params}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            self._execute_params |= {"max_length", "hf_tokenizer", "llm_engine", "images"}
        return self

    async def execute(self, prompt: str, label: Any, sampling_params: SamplingParams,
                      max_length: int | None = None, hf_tokenizer: Any = None, llm_engine: Any = None,
                      images: Any = None) -> Trajectory | dict:
        """One episode -> a Trajectory (or OpenRLHF's result dict)."""
        if self.agent_instance_cls is None:
            raise NotImplementedError(f"{type(self).__name__} must implement execute() or be given an "
                                      "AgentInstance class")
        return await run_multi_turn(self, prompt, label, sampling_params, max_length or self.max_length,
                                    hf_tokenizer or self.hf_tokenizer, llm_engine or self.llm_engine, images)

    def reseed(self, seed: int | None) -> None:
        """Base seed for the next ``run_episodes`` call; episode k then samples with ``seed + k``."""
        self.config.sampling_params = self.config.sampling_params.replace(seed=seed)
        self._episode_ids = itertools.count()

    def next_request_id(self) -> int:
        return next(self._request_ids)

    async def run_episode(self, sample: PromptSample, group_index: int = 0) -> Trajectory | DroppedEpisode:
        """One sample -> its Trajectory, or a DroppedEpisode under ``--reward_failure drop``."""
        params = self._episode_params(next(self._episode_ids))
        try:
            out = await self._call_execute(sample, params)
            traj = out if isinstance(out, Trajectory) else self._from_user_output(out)
        except EpisodeError as e:
            if self.config.reward_failure == "stop":
                raise RewardFailure(str(e), sample.prompt, self.source_name) from e
            return self._drop(sample, group_index, str(e))
        traj.prompt, traj.label, traj.group_index = sample.prompt, sample.label, group_index
        return traj

    async def run_episodes(self, samples: Sequence[PromptSample], n_per_prompt: int = 1) -> EpisodeBatch:
        """``n_per_prompt`` concurrent episodes per sample; ``group_index`` = the sample's position.

        Under ``stop`` the first ``RewardFailure`` cancels the other episodes and is raised.
        """
        if not hasattr(self, "config"):
            raise RuntimeError(f"{type(self).__name__}.setup(engine, tokenizer, config) was not called")
        total = len(samples) * n_per_prompt
        concurrent = self.config.max_concurrency or max(1, total)
        limit = asyncio.Semaphore(concurrent)

        async def one(sample: PromptSample, g: int) -> Trajectory | DroppedEpisode:
            async with limit:
                return await self.run_episode(sample, g)

        hint = getattr(self.llm_engine, "expect_requests", None)
        if callable(hint):  # the builtin engine then starts on the whole burst of first turns
            hint(min(total, concurrent))
        tasks = [asyncio.ensure_future(one(s, g)) for g, s in enumerate(samples) for _ in range(n_per_prompt)]
        await _gather_or_cancel(tasks)
        results = [t.result() for t in tasks]
        return EpisodeBatch(trajectories=[r for r in results if isinstance(r, Trajectory)],
                            dropped=[r for r in results if isinstance(r, DroppedEpisode)])

    # -- helpers

    def _episode_params(self, episode_id: int) -> SamplingParams:
        """Distinct seeds per episode when a seed is set (n samples of a prompt must differ)."""
        p = self.config.sampling_params
        return p if p.seed is None else p.replace(seed=p.seed + episode_id)

    async def _call_execute(self, sample: PromptSample, params: SamplingParams) -> Any:
        """Pass only the arguments the (possibly user-overridden) ``execute`` accepts."""
        extra = {"max_length": self.max_length, "hf_tokenizer": self.hf_tokenizer, "llm_engine": self.llm_engine,
                 "images": sample.images or None, "sample": sample}
        kw = {k: v for k, v in extra.items() if k in self._execute_params}
        if not self._user_execute:
            return await self.execute(sample.prompt, sample.label, params, **kw)
        try:
            return await self.execute(sample.prompt, sample.label, params, **kw)
        except EpisodeError:
            raise
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # user code may not end the trainer
            raise EpisodeError(f"execute() raised {type(e).__name__}: {e}") from e

    def _from_user_output(self, out: Any) -> Trajectory:
        if isinstance(out, dict):
            return trajectory_from_dict(out, self.source_name)
        raise EpisodeError(f"execute() must return a Trajectory or a dict, got {type(out).__name__}")

    def _drop(self, sample: PromptSample, group_index: int, reason: str) -> DroppedEpisode:
        self.num_dropped += 1
        logger.debug("%s: dropped a sample (--reward_failure drop): %s; prompt: %r",  # the loop sums them up
                     self.source_name, reason, sample.prompt[:200])
        return DroppedEpisode(sample.prompt, sample.label, group_index, reason)


async def _gather_or_cancel(tasks: list[asyncio.Future]) -> None:
    """Wait for all tasks; on the first exception cancel the rest and raise it."""
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in done if not t.cancelled() and t.exception() is not None]
    if failed:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed[0].exception()
