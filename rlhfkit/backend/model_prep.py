"""How the training backend prepares a model in place: parameter dtype casts, a forward under
autocast, and torch.compile of each transformer block (`--torch_compile`). Used by FSDP2Backend."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from rlhfkit.parallel.sharding import find_blocks


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


def compile_blocks(model: nn.Module, dynamic: bool | None = None) -> None:
    """torch.compile every transformer block in place (`--torch_compile`); `dynamic` as torch.compile's."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError("--torch_compile: no transformer blocks found in the model")
    for block in blocks:
        block.compile(dynamic=dynamic)
