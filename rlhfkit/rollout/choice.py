"""Choosing the rollout engine, once: `choose_engine(--rollout_engine, model config) -> EngineChoice`.

    auto     builtin when the builtin engine can run the model (`builtin_support`, its own checks);
             else vllm when the package is installed and the run has no pictures (rlhfkit's vLLM
             adapter takes text only); else hf (transformers `generate`, slow but any causal LM)
    builtin  as asked; a model it cannot run is an error naming the flag and the reason
    hf       as asked
    vllm     as asked (a missing package is reported where the engine is built)

OpenRLHF has no such flag (it always generates with vLLM), so its command lines get `auto`. A
fallback of auto carries its reason (`EngineChoice.describe()`), which the commands print as one
line; the commands resolve the flag once, before any model is loaded, and build the engine the
choice names (rlhfkit.rollout.build_engine takes only a concrete name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.config.errors import UsageError
from rlhfkit.optional import is_installed

ENGINES = ("builtin", "hf", "vllm")  # what build_engine builds
CHOICES = ("auto",) + ENGINES  # the --rollout_engine flag's values


@dataclass(frozen=True)
class EngineChoice:
    """The engine that runs (`name`, one of ENGINES) and, when auto did not take the builtin
    engine, why (`reason`; empty otherwise)."""

    name: str
    reason: str = ""

    @property
    def fell_back(self) -> bool:
        return bool(self.reason)

    def describe(self) -> str:
        """One line: which engine runs and why."""
        return f"rollout engine: {self.name}" + (f" ({self.reason})" if self.reason else "")


def model_config(model: Any) -> Any:
    """The transformers config of a model directory (or hub snapshot), an HF module or a config."""
    if isinstance(model, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    return model.config if isinstance(model, torch.nn.Module) else model


def choose_engine(requested: str, model: Any, *, max_model_len: int | None = None, pictures: bool = False,
                  vllm_installed: bool | None = None) -> EngineChoice:
    """The engine for `--rollout_engine requested` and `model` (a directory, config or module;
    read only for auto and builtin). `max_model_len`: the longest sequence the engine must hold;
    `pictures`: the run generates from images; `vllm_installed` defaults to whether vllm imports."""
    if requested not in CHOICES:
        raise UsageError(f"--rollout_engine must be one of {', '.join(CHOICES)}, got {requested!r}")
    if requested in ("hf", "vllm"):
        return EngineChoice(requested)
    why = _builtin_refusal(model, max_model_len)
    if why is None:
        return EngineChoice("builtin")
    if requested == "builtin":
        raise UsageError(f"--rollout_engine builtin cannot run this model: {why}; use --rollout_engine auto "
                         "(the default: vllm when installed, else hf) or hf")
    vllm = is_installed("vllm") if vllm_installed is None else vllm_installed
    if vllm and not pictures:
        return EngineChoice("vllm", f"auto: {why}")
    why_not_vllm = "vLLM takes no pictures in rlhfkit" if pictures else \
        "transformers generate is slower than vLLM, which auto takes when installed"
    return EngineChoice("hf", f"auto: {why}; {why_not_vllm}")


def _builtin_refusal(model: Any, max_model_len: int | None) -> str | None:
    from rlhfkit.rollout.builtin.model.supported import builtin_support

    try:
        config = model_config(model)
    except (OSError, ValueError, KeyError) as e:  # no config.json, an architecture transformers does not know
        return f"its config could not be read ({type(e).__name__}: {e})"
    return builtin_support(config, max_model_len)
