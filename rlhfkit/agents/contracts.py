"""The agent contracts that everything in `rlhfkit.agents` shares (a leaf module: it imports no other
agents module): `AgentConfig`, the episode records, `RewardFailure`, the checks on
what user code returns (OpenRLHF's key names, see `base.py`'s docstring), `call_user` (user code in
its own thread under a time limit) and `AgentInstanceBase`, the environment an agent file defines.
"""


from __future__ import annotations

import inspect
import logging
import math
import numbers
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from rlhfkit.config.declare import default_of
from rlhfkit.config.rl_flags import RewardSourceFlags
from rlhfkit.usercode.run import EpisodeError, UserLoop, run_user_code
from rlhfkit.types import SamplingParams, Trajectory

if TYPE_CHECKING:
    from rlhfkit.models.vlm import VisionContext

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
    vision: a vision-language policy's picture handling (`rlhfkit.models.vlm.VisionContext`): the
        prompts' pictures and those ``step()`` returns as ``environment_images`` are processed with
        it and sent with each generation; None for text.
    """

    max_length: int = 2048
    sampling_params: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=1024))
    step_timeout_s: float | None = 300.0
    reward_timeout_s: float | None = 300.0
    reward_failure: str = default_of(RewardSourceFlags, "reward_failure")
    reward_batch_size: int = 64
    max_concurrency: int | None = None
    vision: "VisionContext | None" = None

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
    images: list[Any] = field(default_factory=list)  # environment_images: pictures the feedback shows


_STEP_REQUIRED = ("rewards", "environment_feedback", "done")
_STEP_KNOWN = set(_STEP_REQUIRED) | {"scores", "sampling_params", "extra_logs", "environment_images"}


def check_step_result(result: Any, source: str) -> StepResult:
    """Validate the dict returned by ``AgentInstance.step`` (keys as in the OpenRLHF guide)."""
    if not isinstance(result, dict):
        raise EpisodeError(f"step() must return a dict, got {type(result).__name__}")
    missing = [k for k in _STEP_REQUIRED if k not in result]
    if missing:
        raise EpisodeError(f"step() result lacks {missing} (got keys {sorted(result)}); required: "
                           f"{list(_STEP_REQUIRED)}, optional: scores, sampling_params, extra_logs, "
                           "environment_images")
    extra = set(result) - _STEP_KNOWN
    if extra:
        logger.warning("%s: step() returned keys that are ignored: %s", source, sorted(extra))
    feedback = result["environment_feedback"]
    if not isinstance(feedback, str):
        raise EpisodeError(f"step() environment_feedback must be a str, got {type(feedback).__name__}")
    scores = result.get("scores")
    images = result.get("environment_images")
    if images is None:
        images = []
    elif not isinstance(images, (list, tuple)):
        raise EpisodeError(f"step() environment_images must be a list of pictures, got {type(images).__name__}")
    return StepResult(
        reward=to_float(result["rewards"], "step() rewards", source),
        score=None if scores is None else to_float(scores, "step() scores", source),
        feedback=feedback,
        done=to_bool(result["done"], "step() done"),
        sampling_params=result.get("sampling_params"),
        extra_logs=to_float_logs(result.get("extra_logs"), "step() extra_logs", source),
        images=list(images),
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
