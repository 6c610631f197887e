"""`RewardOutput`: the rewards of a batch of samples, as every reward source returns them.

OpenRLHF's protocol (reward_func files and the HTTP reward server alike) is a dict
`{"rewards": [...], "scores": [...], "extra_logs": {name: [...] or value}}`: `rewards` drive the
advantages, `scores` (default: the rewards) drive dynamic filtering and pass@k, `extra_logs` are
logged. `RewardOutput.from_mapping` validates such a dict on entry (lengths, numbers, finiteness)
and names its source in every error, so nothing untyped travels further.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class RewardShapeError(ValueError):
    """A reward answer of the wrong shape for the whole call (one number, not a list, a wrong length),
    as opposed to one bad value (a sample's NaN)."""


def _as_floats(value: Any, n: int, what: str, source: str, allow_bool: bool = False) -> list[float]:
    """A tensor / array / list / tuple -> n finite floats: one per sample, never one number for all
    (not even for one sample: a function returning one number would be broadcast silently).

    Booleans count as 0/1 only where `allow_bool` (extra_logs such as {"correct": [True, False]})."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # torch tensors, numpy arrays
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        samples = "1 sample" if n == 1 else f"{n} samples"
        raise RewardShapeError(f"{source}: '{what}' is one number ({value!r}) for {samples}; return one per "
                               f"sample (a list or tensor of {n})")
    if not isinstance(value, (list, tuple)):
        raise RewardShapeError(f"{source}: '{what}' must be a list of {n} numbers, got {type(value).__name__}")
    if len(value) != n:
        raise RewardShapeError(f"{source}: '{what}' has {len(value)} values for {n} samples")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, (list, tuple)) and len(v) == 1:  # [[r], ...] as an [n, 1] tensor gives
            v = v[0]
        if (isinstance(v, bool) and not allow_bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{source}: '{what}'[{i}] must be a number, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"{source}: '{what}'[{i}] is {v} (not finite)")
        out.append(float(v))
    return out


def _extra_logs(value: Any, n: int, source: str) -> dict[str, list[float] | float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{source}: 'extra_logs' must be a dict of name -> number or list, got {type(value).__name__}")
    out: dict[str, list[float] | float] = {}
    for k, v in value.items():
        if hasattr(v, "tolist") and not isinstance(v, (list, tuple)):
            v = v.tolist()
        if isinstance(v, (list, tuple)):
            out[str(k)] = _as_floats(v, n, f"extra_logs.{k}", source, allow_bool=True)
        elif isinstance(v, (int, float)):  # one number (or bool) for the whole batch
            out[str(k)] = float(v)
        else:
            raise ValueError(f"{source}: 'extra_logs.{k}' must be a number or a list of {n} numbers, got {v!r}")
    return out


@dataclass
class RewardOutput:
    """Rewards for n samples. extra_logs values are per-sample lists (length n) or one number."""

    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float] | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.rewards):
            raise ValueError(f"RewardOutput: {len(self.scores)} scores for {len(self.rewards)} rewards")

    def __len__(self) -> int:
        return len(self.rewards)

    @classmethod
    def from_mapping(cls, obj: Any, n: int, source: str) -> "RewardOutput":
        """Validate a `{"rewards", "scores"?, "extra_logs"?}` dict for n samples; `source` names it in errors."""
        if not isinstance(obj, Mapping):
            raise RewardShapeError(f"{source}: expected a dict with 'rewards', got {type(obj).__name__}")
        if "rewards" not in obj:
            raise RewardShapeError(f"{source}: the result has no 'rewards' (keys: {sorted(map(str, obj))})")
        rewards = _as_floats(obj["rewards"], n, "rewards", source)
        scores = rewards if obj.get("scores") is None else _as_floats(obj["scores"], n, "scores", source)
        return cls(rewards, list(scores), _extra_logs(obj.get("extra_logs"), n, source))

    def sample_logs(self, i: int) -> dict[str, float]:
        """extra_logs of sample i (a per-sample list gives its i-th value, a number is shared)."""
        return {k: (v[i] if isinstance(v, list) else v) for k, v in self.extra_logs.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"rewards": list(self.rewards), "scores": list(self.scores), "extra_logs": dict(self.extra_logs)}

    @classmethod
    def concat(cls, parts: Sequence["RewardOutput"]) -> "RewardOutput":
        """Join outputs of consecutive sample ranges (shared numbers become per-sample lists)."""
        rewards = [r for p in parts for r in p.rewards]
        scores = [s for p in parts for s in p.scores]
        names = sorted({k for p in parts for k in p.extra_logs})
        logs: dict[str, list[float] | float] = {}
        for k in names:
            if any(k not in p.extra_logs for p in parts):
                continue  # a name some parts lack cannot be aligned with the samples
            logs[k] = [p.sample_logs(i)[k] for p in parts for i in range(len(p))]
        return cls(rewards, scores, logs)
