"""rlhfkit: RLHF and agentic RL for language models.

Command lines: `python -m rlhfkit.cli.train_sft ...` (or `rlhfkit sft ...`). Python API (rlhfkit.api,
docs/api.md), exported here lazily so that `import rlhfkit` stays cheap (torch and transformers load
on first use of a name):

    from rlhfkit import SFTConfig, SFTTrainer, GRPOConfig, GRPOTrainer
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "SFTConfig", "SFTTrainer", "RewardConfig", "RewardTrainer", "DPOConfig", "DPOTrainer",
           "KTOConfig", "KTOTrainer", "PPOConfig", "PPOTrainer", "GRPOConfig", "GRPOTrainer", "RLOOConfig",
           "RLOOTrainer", "per_sample", "metric_values", "mean_metric"]
_API = frozenset(__all__[1:])  # names of rlhfkit.api, imported on first use


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module("rlhfkit.api"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlhfkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
