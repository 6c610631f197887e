"""Agent API (OpenRLHF-compatible): AgentInstanceBase, AgentExecutorBase, and the checks on user output.

A user file (``--agent_func_path``) defines an environment as an ``AgentInstance(AgentInstanceBase)``
and usually wraps it in ``AgentExecutor(MultiTurnAgentExecutor)``; see ``examples/agent_func*.py``.
Executors run episodes token in, token out against a ``RolloutEngine``:

    PromptSample --execute()--> Trajectory (or OpenRLHF's dict, converted and checked here)
    run_episodes(samples, n) --> EpisodeBatch(trajectories, dropped)

User code is called through ``call_user``: in a worker thread with its own event loop (one per
episode, see ``user_code.py``), under a time limit that ends even a call that blocks; any exception
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
import math
import numbers
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from rlhfkit.agents.user_code import EpisodeError, UserLoop, run_user_code
from rlhfkit.types import PromptSample, SamplingParams, Trajectory

logger = logging.getLogger(__name__)

FAILURE_POLICIES = ("stop", "drop")


# ----------------------------------------------------------------------------- config and records


@dataclass
class AgentConfig:
    """Settings of an executor (flags in brackets).

    max_length: token budget of a whole trajectory, prompt + actions + feedback
        (``--max_len``, or ``--prompt_max_len + --generate_max_len``).
    sampling_params: default sampling; ``max_new_tokens`` is the limit of one generation
        (``--generate_max_len``); a turn also stops at the remaining budget. ``max_new_tokens ==
        max_length`` means no limit of its own: each generation gets what the budget leaves
        (OpenRLHF's unset ``--rollout.max_new_tokens``).
    step_timeout_s: limit of each ``reset()`` / ``step()`` call; None = no limit.
    reward_timeout_s: limit of each ``reward_func`` call; None = no limit.
    reward_failure: ``stop`` (raise ``RewardFailure``) or ``drop`` (skip and count the sample).
    reward_batch_size: single-turn: concurrent reward calls are merged into batches of at most
        this many samples (1 = one call per sample, as OpenRLHF does).
    max_concurrency: episodes in flight at once; None = all.
    """

    max_length: int = 2048
    sampling_params: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=1024))
    step_timeout_s: float | None = 300.0
    reward_timeout_s: float | None = 300.0
    reward_failure: str = "stop"
    reward_batch_size: int = 64
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.reward_failure not in FAILURE_POLICIES:
            raise ValueError(f"--reward_failure must be one of {FAILURE_POLICIES}, got {self.reward_failure!r}")
        new = self.sampling_params.max_new_tokens
        if not 0 < new <= self.max_length:
            raise ValueError(f"--generate_max_len ({new}) must be positive and at most the trajectory budget "
                             f"--max_len ({self.max_length})")
        if self.reward_batch_size < 1:
            raise ValueError(f"reward_batch_size must be >= 1, got {self.reward_batch_size}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {self.max_concurrency}")


@dataclass
class DroppedEpisode:
    """A sample left out under ``--reward_failure drop``."""

    prompt: str
    label: Any
    group_index: int
    reason: str


@dataclass
class EpisodeBatch:
    """What ``run_episodes`` returns. Trajectories are ordered by prompt, then sample; a group
    (same ``group_index``) may hold fewer than n trajectories when samples were dropped."""

    trajectories: list[Trajectory]
    dropped: list[DroppedEpisode] = field(default_factory=list)

    @property
    def num_dropped(self) -> int:
        return len(self.dropped)


class RewardFailure(RuntimeError):
    """Raised under ``--reward_failure stop`` when user code fails for a sample. Its text is one
    line (the CLI prints it as the run's only error line): source file, error, the sample's prompt."""

    PROMPT_CHARS = 200

    def __init__(self, message: str, prompt: str, source: str) -> None:
        self.message, self.prompt, self.source = message, prompt, source
        shown = prompt if len(prompt) <= self.PROMPT_CHARS else prompt[:self.PROMPT_CHARS] + "..."
        head = message if message.startswith(source) else f"{source}: {message}"
        head = re.sub(r"\s*\n\s*", " | ", head.strip())
        super().__init__(f"{head}; sample prompt: {shown!r} "
                         f"(--reward_failure drop skips and counts such samples instead)")


# ----------------------------------------------------------------------------- value checks


def to_float(value: Any, what: str, source: str) -> float:
    """A Python/numpy number, a one-element tensor/array or a one-element list -> finite float."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise EpisodeError(f"{what} must be one number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "size", None) == 1:  # numpy array / scalar
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise EpisodeError(f"{what} must be a number or a one-element tensor, got {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x):
        raise EpisodeError(f"{what} is {x}; it must be finite")
    return x


def to_bool(value: Any, what: str) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (bool, int)) or type(value).__name__ == "bool_":
        return bool(value)
    raise EpisodeError(f"{what} must be a bool, got {type(value).__name__}")


def to_float_logs(logs: Any, what: str, source: str) -> dict[str, float]:
    """``extra_logs`` dict -> {name: float}; every value must be one number."""
    if logs is None:
        return {}
    if not isinstance(logs, dict):
        raise EpisodeError(f"{what} must be a dict of numbers, got {type(logs).__name__}")
    return {str(k): to_float(v, f"{what}[{k!r}]", source) for k, v in logs.items()}


_VLLM_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


def coerce_sampling_params(value: Any, current: SamplingParams, source: str) -> SamplingParams:
    """Per-step ``sampling_params`` from ``step()``: None keeps ``current``; accepts our
    SamplingParams, a dict, or a vLLM-style object (``max_tokens``, ``min_tokens`` names)."""
    if not value:
        return current
    if isinstance(value, SamplingParams):
        return value
    ours = set(current.__dict__)
    if isinstance(value, dict):
        items = value.items()
    else:  # a vLLM SamplingParams or similar: read the attributes we know
        names = list(ours) + list(_VLLM_NAMES)
        items = [(k, getattr(value, k)) for k in names if hasattr(value, k)]
    out: dict[str, Any] = {}
    for key, v in items:
        key = _VLLM_NAMES.get(key, key)
        if key not in ours:
            raise EpisodeError(f"sampling_params has unknown field {key!r} (known: {sorted(ours)})")
        if key == "top_k" and v == 0:
            v = -1
        if key == "logprobs":
            v = v is not None and v is not False
        if key == "stop" and isinstance(v, str):
            v = [v]
        out[key] = list(v) if key in ("stop", "stop_token_ids") and v is not None else v
    return current.replace(**{k: v for k, v in out.items() if v is not None})


@dataclass
class StepResult:
    """A checked ``step()`` return value."""

    reward: float
    score: float | None
    feedback: str
    done: bool
    sampling_params: Any
    extra_logs: dict[str, float]


_STEP_REQUIRED = ("rewards", "environment_feedback", "done")
_STEP_KNOWN = set(_STEP_REQUIRED) | {"scores", "sampling_params", "extra_logs"}


def check_step_result(result: Any, source: str) -> StepResult:
    """Validate the dict returned by ``AgentInstance.step`` (keys as in the OpenRLHF guide)."""
    if not isinstance(result, dict):
        raise EpisodeError(f"step() must return a dict, got {type(result).__name__}")
    missing = [k for k in _STEP_REQUIRED if k not in result]
    if missing:
        raise EpisodeError(f"step() result lacks {missing} (got keys {sorted(result)}); required: "
                           f"{list(_STEP_REQUIRED)}, optional: scores, sampling_params, extra_logs")
    extra = set(result) - _STEP_KNOWN
    if extra:
        logger.warning("%s: step() returned keys that are ignored: %s", source, sorted(extra))
    feedback = result["environment_feedback"]
    if not isinstance(feedback, str):
        raise EpisodeError(f"step() environment_feedback must be a str, got {type(feedback).__name__}")
    scores = result.get("scores")
    return StepResult(
        reward=to_float(result["rewards"], "step() rewards", source),
        score=None if scores is None else to_float(scores, "step() scores", source),
        feedback=feedback,
        done=to_bool(result["done"], "step() done"),
        sampling_params=result.get("sampling_params"),
        extra_logs=to_float_logs(result.get("extra_logs"), "step() extra_logs", source),
    )


def check_reset_result(result: Any) -> str:
    """``reset()`` must return {"observation": str}; gives the observation text."""
    if not isinstance(result, dict) or "observation" not in result:
        got = sorted(result) if isinstance(result, dict) else type(result).__name__
        raise EpisodeError(f'reset() must return a dict with key "observation", got {got}')
    if not isinstance(result["observation"], str):
        raise EpisodeError(f"reset() observation must be a str, got {type(result['observation']).__name__}")
    return result["observation"]


def trajectory_from_dict(out: dict, source: str) -> Trajectory:
    """Convert the dict a custom OpenRLHF ``execute()`` returns (``observation_tokens``,
    ``action_ranges``, ``rollout_log_probs``, ``reward``, ``scores``, ``extra_logs``, ``truncated``)."""
    for key in ("observation_tokens", "action_ranges", "reward"):
        if key not in out:
            raise EpisodeError(f"execute() result lacks {key!r} (got keys {sorted(out)})")
    ids = [int(t) for t in out["observation_tokens"]]
    mask = [0] * len(ids)
    for rng in out["action_ranges"]:
        start, end = int(rng[0]), int(rng[1])
        if not 0 <= start <= end <= len(ids):
            raise EpisodeError(f"execute() action range {rng} is outside the {len(ids)} observation tokens")
        mask[start:end] = [1] * (end - start)
    logps = out.get("rollout_log_probs")
    if logps is None:
        logger.warning("%s: execute() gave no rollout_log_probs; using 0 (IS correction needs them)", source)
        logps = [0.0] * len(ids)
    if len(logps) != len(ids):
        raise EpisodeError(f"execute() rollout_log_probs has {len(logps)} entries for {len(ids)} tokens")
    if out["reward"] is None:
        raise EpisodeError("execute() returned reward None; compute a reward in execute()")
    reward = to_float(out["reward"], "execute() reward", source)
    scores = out.get("scores")
    starts = [i for i, m in enumerate(mask) if m]
    return Trajectory(
        token_ids=ids, action_mask=mask, rollout_logprobs=[float(x) * m for x, m in zip(logps, mask)],
        prompt_len=starts[0] if starts else len(ids), reward=reward,
        score=reward if scores is None else to_float(scores, "execute() scores", source),
        truncated=bool(out.get("truncated", False)),
        extra_logs=to_float_logs(out.get("extra_logs"), "execute() extra_logs", source),
    )


# ----------------------------------------------------------------------------- calling user code


async def call_user(fn: Callable[..., Any], *args: Any, what: str, timeout_s: float | None,
                    loop: UserLoop | None = None) -> Any:
    """Call user code (sync or async) on ``loop`` (a worker thread's event loop; a fresh one when
    None) under a time limit that also ends blocking code; any failure becomes ``EpisodeError``."""
    return await run_user_code(fn, *args, what=what, timeout_s=timeout_s, loop=loop)


async def create_agent_instance(cls: type, timeout_s: float | None,
                                loop: UserLoop | None = None) -> "AgentInstanceBase":
    """Instantiate with no arguments, as OpenRLHF does; an ``async def __init__`` (as in
    OpenRLHF's README) is awaited."""
    if inspect.iscoroutinefunction(cls.__init__):
        obj = cls.__new__(cls)
        await call_user(cls.__init__, obj, what=f"{cls.__name__}.__init__()", timeout_s=timeout_s, loop=loop)
        return obj
    return await call_user(cls, what=f"{cls.__name__}()", timeout_s=timeout_s, loop=loop)


# ----------------------------------------------------------------------------- base classes


class AgentInstanceBase(ABC):
    """One environment episode. A fresh instance (no constructor arguments) serves each sample."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        """``states = {"observation": prompt, "label": label}``; returns {"observation": text}."""
        return {"observation": states["observation"]}

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict:
        """See the module docstring for ``states`` and the keys of the returned dict."""


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
            self._execute_params |= {"max_length", "hf_tokenizer", "llm_engine"}
        return self

    async def execute(self, prompt: str, label: Any, sampling_params: SamplingParams,
                      max_length: int | None = None, hf_tokenizer: Any = None, llm_engine: Any = None,
                      images: Any = None) -> Trajectory | dict:
        """One episode -> a Trajectory (or OpenRLHF's result dict)."""
        if self.agent_instance_cls is None:
            raise NotImplementedError(f"{type(self).__name__} must implement execute() or be given an "
                                      "AgentInstance class")
        from rlhfkit.agents.executors import run_multi_turn

        return await run_multi_turn(self, prompt, label, sampling_params, max_length or self.max_length,
                                    hf_tokenizer or self.hf_tokenizer, llm_engine or self.llm_engine)

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
        limit = asyncio.Semaphore(self.config.max_concurrency or max(1, len(samples) * n_per_prompt))

        async def one(sample: PromptSample, g: int) -> Trajectory | DroppedEpisode:
            async with limit:
                return await self.run_episode(sample, g)

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
        extra = {"max_length": self.max_length, "hf_tokenizer": self.hf_tokenizer, "llm_engine": self.llm_engine}
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
        logger.warning("%s: dropped a sample (--reward_failure drop): %s; prompt: %r",
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
