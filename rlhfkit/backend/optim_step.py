"""The optimizer step launched before its skip decision reaches the host (one process, fused AdamW).

The non-finite guard (guard.py) decides after the backward whether a step is applied. Read on the
host before the update is launched, that decision drains the GPU: it idles while the host copies the
flags, decides, and launches clipping and AdamW. With a fused optimizer the decision can stay on the
device instead, as under torch's GradScaler: the optimizer's `found_inf` tensor makes the fused
kernel skip the whole update (weights, moments and step counts unchanged) when it is non-zero. So:

    flags = [norm non-finite, a loss non-finite, last step's weights non-finite / grown, a loss non-zero,
             norm]                                                                        (device)
    copy the flags to pinned host memory behind the backward; record an event
    AdamW with found_inf = any of the first four and grad_scale = the clip factor's inverse  (queued)
    wait for the event (not for AdamW) -> the guard decides on the host as before

Only where every rank would take the decision alone: one process, no fp16 loss scale (its skipped
steps change the scale first), a fused optimizer on the GPU. Elsewhere the backend decides first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlhfkit.backend import host_gc
from rlhfkit.backend.guard import StepGuard
from rlhfkit.parallel.sharding import clip_grads, global_grad_norm


def decide_and_step(opt: torch.optim.Optimizer, params: list[nn.Parameter], norm: torch.Tensor,
                    guard: StepGuard, max_norm: float, several_ranks: bool, loss_scale: bool
                    ) -> tuple[bool, bool, float]:
    """The guard's decision, and clip + step when it says finite: (finite, a loss non-finite, grad norm)."""
    if can_mask_step(opt, norm, several_ranks, loss_scale):
        return masked_step(opt, norm, guard, max_norm)
    host_gc.collect_deferred()  # the host is about to wait for the backward anyway
    finite, loss_bad, norm_value = guard.decide(norm)
    if finite:
        if max_norm > 0:
            clip_grads(params, max_norm, norm)
        opt.step()
    return finite, loss_bad, norm_value


def step_grad_norm(opt: torch.optim.Optimizer, params: list[nn.Parameter], master: Any, several_ranks: bool,
                   loss_scale: bool) -> torch.Tensor:
    """The global gradient norm of `params`; where the master weights keep bf16 gradients for the
    fused step (master_adamw.py), over those, upcast into `.grad` if the step will not be masked
    (then `clip_grads` scales the masters' `.grad`)."""
    if master is None or not master.keep_low_grads:
        return global_grad_norm(params)
    norm = master.grad_norm()
    if not can_mask_step(opt, norm, several_ranks, loss_scale):
        master.materialize_grads()
    return norm


def can_mask_step(opt: torch.optim.Optimizer, norm: torch.Tensor, several_ranks: bool, loss_scale: bool) -> bool:
    return (norm.is_cuda and not several_ranks and not loss_scale
            and bool(getattr(opt, "_step_supports_amp_scaling", False)))


def masked_step(opt: torch.optim.Optimizer, norm: torch.Tensor, guard: StepGuard, max_norm: float
                ) -> tuple[bool, bool, float]:
    """Clipped step queued behind the decision's flags, masked on the device; returns `guard.decide`'s
    (finite, loss non-finite, grad norm)."""
    flags = guard.device_flags(norm)
    host, ready = flags, None
    if flags.is_cuda:
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    # clipping folded into the fused kernel: it divides each gradient by grad_scale as it reads it
    # (no pass over the gradients); 1 / min(1, max_norm / (norm + 1e-6)) is clip_grads' factor
    scale = torch.clamp((norm.detach().float() + 1e-6) / max_norm, min=1.0) if max_norm > 0 else None
    opt.found_inf = guard.no_step(flags)  # type: ignore[attr-defined]
    opt.grad_scale = scale  # type: ignore[attr-defined]
    try:
        opt.step()
    finally:
        del opt.found_inf, opt.grad_scale  # type: ignore[attr-defined]
    host_gc.collect_deferred()  # the host is about to wait for the backward anyway
    if ready is not None:
        ready.synchronize()
    return guard.decide_host(host)
