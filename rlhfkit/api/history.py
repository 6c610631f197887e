"""Reading a metrics history (what `train()` returns, one dict per logged step, as in metrics.jsonl).

    metric_values(history, "reward")   [values of the records that have it], whatever the key's prefix
    mean_metric(history[-5:], "reward")

Metric keys may carry a namespace ("train/reward", "eval/pass1"); these helpers look a name up
with or without it, so scripts need not know which.
"""

from __future__ import annotations

from typing import Any, Sequence

PREFIXES = ("", "train/", "eval/")


def metric_key(record: dict[str, Any], name: str) -> str | None:
    """The key of `record` that holds metric `name` (`name`, `train/name` or `eval/name`), or None."""
    for prefix in PREFIXES:
        if prefix + name in record:
            return prefix + name
    return None


def metric_values(history: Sequence[dict[str, Any]], name: str) -> list[float]:
    """The numeric values of metric `name` in `history`, in order (records without it are skipped)."""
    out = []
    for rec in history:
        key = metric_key(rec, name)
        if key is not None and isinstance(rec[key], (int, float)):
            out.append(float(rec[key]))
    return out


def mean_metric(history: Sequence[dict[str, Any]], name: str) -> float:
    """The mean of `metric_values(history, name)`; ValueError when no record has it."""
    values = metric_values(history, name)
    if not values:
        raise ValueError(f"no logged record has the metric {name!r}")
    return sum(values) / len(values)
