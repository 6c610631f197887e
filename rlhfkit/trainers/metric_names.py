"""The names of logged metrics (a leaf module: metrics.py, plot.py and model_card.py read it).

    train/<name>   a training metric; the loops hand bare names ("loss" is logged as "train/loss")
    eval/<name>    an evaluation metric; evaluate() functions name theirs "eval/<name>" themselves
    time/<name>    the seconds an RL step spent in each phase (any name with a "/" keeps its namespace)

Every record (a line of metrics.jsonl) also has "step".
"""

from __future__ import annotations

import json
from typing import Any

TRAIN, EVAL, TIME = "train/", "eval/", "time/"

# the training metrics a console line (and a model card) shows, in this order (those present)
CONSOLE_KEYS = ("loss", "reward", "acc", "margin", "chosen_reward", "rejected_reward", "kd_loss", "nll_loss",
                "kl", "response_length", "truncated_rate", "equal_reward_groups", "entropy", "policy_loss", "value_loss",
                "grad_norm", "lr", "actor_lr")
SECONDS_KEYS = ("train/step_time", "time/step")  # the seconds a step took (offline loop, RL loop)


def qualified(name: str) -> str:
    """The logged name of metric `name`: a bare name is a training metric (train/<name>)."""
    return name if "/" in name else TRAIN + name


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
