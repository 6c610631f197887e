"""How the training backend sets a model's precision in place: parameter dtype casts and a forward
under autocast; which entries of a 4-bit (QLoRA) model checkpoints leave out. Used by FSDP2Backend
(parallelism is applied by rlhfkit.parallel.apply)."""

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


def four_bit_weights(model: nn.Module) -> frozenset[str]:
    """State-dict names of the model's bitsandbytes 4-bit weights (--load_in_4bit: a frozen base). Their
    entries (the packed values, and their quantization state under the same name + ".") stay out of training
    checkpoints: the base is loaded and quantized again from --pretrain when a run resumes."""
    from rlhfkit.models.loader import is_4bit

    return frozenset(name for name, p in model.named_parameters() if is_4bit(p))


def is_four_bit_key(key: str, names: frozenset[str]) -> bool:
    """Whether state-dict entry `key` belongs to one of the 4-bit weights `names`."""
    cut = key.find(".weight.")
    return key in names or (cut >= 0 and key[:cut + len(".weight")] in names)


def without_four_bit(sd: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """`sd` without the entries of the 4-bit weights `names`."""
    return {k: v for k, v in sd.items() if not is_four_bit_key(k, names)} if names else sd
