"""Reading a metrics history (what `train()` returns, one dict per logged step, as in metrics.jsonl).

    metric_values(history, "reward")   [values of the records that have it], whatever the key's prefix
    mean_metric(history[-5:], "reward")

Metric keys may carry a namespace ("train/reward", "eval/pass1" for "eval_pass1"); these helpers
look a name up in either spelling, so scripts need not know which.
"""

from __future__ import annotations

from typing import Any, Sequence


def _candidates(name: str) -> list[str]:
    """The spellings metric `name` may have: "reward" / "train/reward"; "eval_pass1" / "eval/pass1"."""
    out = [name, "train/" + name]
    for flat, spaced in (("eval_", "eval/"), ("train_", "train/")):
        if name.startswith(flat):
            out.append(spaced + name[len(flat):])
        elif name.startswith(spaced):
            out.append(flat + name[len(spaced):])
    return out


def metric_key(record: dict[str, Any], name: str) -> str | None:
    """The key of `record` that holds metric `name` (see `_candidates`), or None."""
    return next((k for k in _candidates(name) if k in record), None)


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
