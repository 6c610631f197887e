"""The settings that make a run the run it is, and the check that a resume continues that run.

A checkpoint records them (client state `run_settings`), and so does the run directory's
run_config.json; `--load_checkpoint` compares both with the run being started:

    model   --pretrain, --ref_pretrain, --critic_pretrain, --reward_pretrain, --teacher_model, --lora_rank
    data    --dataset, --dataset_probs, --prompt_data, --prompt_data_probs, the column flags, --max_samples,
            --seed (the data order)
    batch   --train_batch_size, --rollout_batch_size, --n_samples_per_prompt
    rate    --learning_rate, --actor_learning_rate, --critic_learning_rate, --lr_scheduler,
            --lr_warmup_ratio, --min_lr_ratio

A difference is an error naming each flag with both values; `--allow_resume_changes FLAG,...` (or
`all`) accepts the named ones as deliberate. How long a run lasts (--max_steps, --max_epochs,
--num_episodes) may change: the LR schedule then spans the new length. Paths are compared as real
paths; values the command line cannot give (the Python API's in-memory datasets) are not compared.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from rlhfkit.redact import redact_config

MODEL = ("pretrain", "ref_pretrain", "critic_pretrain", "reward_pretrain", "teacher_model", "lora_rank")
DATA = ("dataset", "dataset_probs", "prompt_data", "prompt_data_probs", "input_key", "output_key", "label_key",
        "prompt_key", "chosen_key", "rejected_key", "max_samples", "seed")
BATCH = ("train_batch_size", "rollout_batch_size", "n_samples_per_prompt")
RATE = ("learning_rate", "actor_learning_rate", "critic_learning_rate", "lr_scheduler", "lr_warmup_ratio",
        "min_lr_ratio")
RUN_SETTINGS = MODEL + DATA + BATCH + RATE


class ResumeMismatch(ValueError):
    """--load_checkpoint of a run with other settings; the message names the flags."""


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def _norm(value: Any) -> Any:
    """Comparable form: real paths for existing local paths (comma lists each), lists for tuples."""
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    if isinstance(value, str) and value:
        return ",".join(os.path.realpath(p) if p and os.path.exists(p) else p for p in value.split(","))
    return value


def run_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The RUN_SETTINGS among `values` (flag dest -> value), comparable and fit to write down."""
    out = {}
    for k in RUN_SETTINGS:
        if k not in values:
            continue
        v = values[k]
        if not _plain(v):
            continue
        out[k] = _norm(v)
    return redact_config(out)


def allowed_changes(spec: str | None) -> frozenset[str]:
    """--allow_resume_changes: comma-separated flag names (with or without --), or "all"."""
    if not spec:
        return frozenset()
    names = {n.strip().removeprefix("--") for n in spec.split(",") if n.strip()}
    return frozenset(RUN_SETTINGS) if "all" in names else frozenset(names)


def differences(saved: dict[str, Any], current: dict[str, Any], allowed: Iterable[str] = ()) -> list[str]:
    """`--flag SAVED (now CURRENT)` for each setting both record with different values, not in `allowed`."""
    allowed = set(allowed)
    out = []
    for k in RUN_SETTINGS:
        if k in allowed or k not in saved or k not in current:
            continue
        a, b = _norm(saved[k]), _norm(current[k])
        if a != b:
            out.append(f"--{k} {_show(a)} (now {_show(b)})")
    return out


def _show(v: Any) -> str:
    if isinstance(v, list):
        return " ".join(map(str, v))
    return str(v)


def check_same_run(saved: dict[str, Any] | None, current: dict[str, Any], allowed: Iterable[str], what: str) -> None:
    """Raise ResumeMismatch naming every setting that differs between the run that wrote `what`
    (its recorded `saved` settings) and this one; nothing recorded: nothing to check."""
    if not saved:
        return
    diff = differences(saved, current, allowed)
    if diff:
        names = ",".join(d.split()[0].removeprefix("--") for d in diff)
        raise ResumeMismatch(f"--load_checkpoint: {what} was made by a run with other settings: {'; '.join(diff)}. "
                             f"Resume with the same settings, or pass --allow_resume_changes {names} to change "
                             "them deliberately")
