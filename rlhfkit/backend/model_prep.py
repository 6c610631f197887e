"""How the training backend sets a model's precision in place: parameter dtype casts and a forward
under autocast. Used by FSDP2Backend (parallelism is applied by rlhfkit.parallel.apply)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def cast_params(model: nn.Module, dtype: torch.dtype, trainable_only: bool, frozen_only: bool = False) -> None:
    """Cast the floating-point parameters to `dtype`: all, the trainable ones only, or the frozen ones only."""
    with torch.no_grad():
        for p in model.parameters():
            pick = p.requires_grad if trainable_only else (not p.requires_grad if frozen_only else True)
            if p.is_floating_point() and p.dtype != dtype and pick:
                p.data = p.data.to(dtype)


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run `model.forward` (and so `model(...)` and `generate`) under autocast(dtype)."""
    orig = model.forward

    @functools.wraps(orig)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return orig(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]

