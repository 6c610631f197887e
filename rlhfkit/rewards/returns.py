"""What a reward function returns, checked: `parse_reward_return` turns a reward_func's answer (a dict with
"rewards", "scores", "extra_logs", or the rewards alone) into a `RewardOutput` for a batch of n, one finite
reward per sample; `check_reward_output` checks any source's answer; `split_reward_output` and
`slice_reward_output` cut one into samples. An answer of the wrong shape for the whole batch is a
`RewardReturnError`; a bad value of one sample an `EpisodeError`."""

from __future__ import annotations

import logging
from typing import Any

from rlhfkit.rewards.output import RewardOutput, RewardShapeError
from rlhfkit.usercode.run import EpisodeError

logger = logging.getLogger(__name__)

_KNOWN_KEYS = {"rewards", "scores", "extra_logs"}


class RewardReturnError(EpisodeError):
    """A reward answer of the wrong shape for the whole batch (one number, a wrong length, no 'rewards')."""


def _check(obj: Any, n: int, source: str) -> RewardOutput:
    try:
        return RewardOutput.from_mapping(obj, n, source)
    except RewardShapeError as e:
        raise RewardReturnError(str(e)) from None
    except ValueError as e:
        raise EpisodeError(str(e)) from e


def parse_reward_return(raw: Any, n: int, source: str) -> RewardOutput:
    """Check what ``reward_func`` returned for a batch of ``n`` and build a RewardOutput."""
    if isinstance(raw, RewardOutput):
        return check_reward_output(raw, n, source)
    if not isinstance(raw, dict):
        if raw is None or isinstance(raw, (str, bytes)):
            raise RewardReturnError(f"{source}: reward_func must return a dict with 'rewards' or the rewards "
                                    f"themselves (tensor / list), got {type(raw).__name__}")
        raw = {"rewards": raw}
    unknown = set(raw) - _KNOWN_KEYS
    if unknown:  # OpenRLHF ignores other keys; say so, since a typo ('score') loses data
        logger.warning("%s: reward_func's dict has keys that are ignored: %s (known: rewards, scores, "
                       "extra_logs)", source, sorted(map(str, unknown)))
    return _check(raw, n, source)


def check_reward_output(out: Any, n: int, source: str) -> RewardOutput:
    """Validate any source's answer for a batch of ``n`` (lengths, finite numbers, extra_logs)."""
    if not isinstance(out, RewardOutput):
        raise RewardReturnError(f"{source}: reward source returned {type(out).__name__}, expected RewardOutput")
    return _check(out.to_dict(), n, source)


def split_reward_output(out: Any, n: int, source: str) -> list[tuple[float, float, dict[str, float]]]:
    """Per-sample (reward, score, extra_logs) from a batch RewardOutput."""
    out = check_reward_output(out, n, source)
    return [(out.rewards[i], out.scores[i], out.sample_logs(i)) for i in range(n)]


def slice_reward_output(out: RewardOutput, start: int, end: int) -> RewardOutput:
    """Samples ``start:end``; shared (single-number) extra_logs stay shared."""
    logs = {k: (v[start:end] if isinstance(v, list) else v) for k, v in out.extra_logs.items()}
    return RewardOutput(rewards=out.rewards[start:end], scores=out.scores[start:end], extra_logs=logs)
