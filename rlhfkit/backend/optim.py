"""AdamW with decay / no-decay parameter groups, and learning-rate schedules by name.

Optimizer: AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019) with
`--learning_rate`, `--adam_betas`, `--adam_eps` and weight decay `--l2`. Biases and the weights
of normalisation layers (LayerNorm, RMSNorm, ...) get no decay. `--optim muon` steps the hidden
layers' 2-D weights with Muon instead (muon.py; `--muon_lr`, same decay `--l2`).

Schedules (`--lr_scheduler`), as a factor f(step) of the base learning rate, with
W = ceil(--lr_warmup_ratio * total) warm-up steps and progress p = (step - W) / max(1, total - W)
clamped to [0, 1]:

    constant               f = 1
    constant_with_warmup   f = step / W during warm-up, then 1
    linear                 warm-up, then f = 1 - p
    cosine                 warm-up, then f = 0.5 (1 + cos(pi p))
    cosine_with_min_lr     warm-up, then f = m + (1 - m) 0.5 (1 + cos(pi p)),  m = --min_lr_ratio

Warm-up starts at f = 0 at step 0, as Hugging Face's schedulers do. Unlike them, progress is
clamped, so steps past `total` stay at the final value instead of rising again.
The schedules are `LambdaLR` factors; `LambdaLR.state_dict()` keeps only the step counters,
which load under `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from rlhfkit.config.configs import OptimConfig

ScheduleFn = Callable[[int, int, int, float], float]  # (step, warmup, total, min_lr_ratio) -> factor


def _progress(step: int, warmup: int, total: int) -> float:
    return min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))


def _warm(step: int, warmup: int) -> float | None:
    """The warm-up factor while `step < warmup`, else None."""
    return step / warmup if step < warmup else None


def constant(step: int, warmup: int, total: int, min_ratio: float) -> float:
    return 1.0


def constant_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    w = _warm(step, warmup)
    return 1.0 if w is None else w


def linear(step: int, warmup: int, total: int, min_ratio: float) -> float:
    w = _warm(step, warmup)
    return 1.0 - _progress(step, warmup, total) if w is None else w


def cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    w = _warm(step, warmup)
    return 0.5 * (1.0 + math.cos(math.pi * _progress(step, warmup, total))) if w is None else w


def cosine_with_min_lr(step: int, warmup: int, total: int, min_ratio: float) -> float:
    w = _warm(step, warmup)
    if w is not None:
        return w
    return min_ratio + (1.0 - min_ratio) * cosine(step, warmup, total, min_ratio)


SCHEDULES: dict[str, ScheduleFn] = {
    "cosine_with_min_lr": cosine_with_min_lr,
    "constant": constant,
    "constant_with_warmup": constant_with_warmup,
    "linear": linear,
    "cosine": cosine,
}


def register_schedule(name: str, fn: ScheduleFn) -> None:
    """Add a schedule usable as `--lr_scheduler <name>`."""
    SCHEDULES[name] = fn


def num_warmup_steps(cfg: OptimConfig, num_training_steps: int) -> int:
    """ceil(--lr_warmup_ratio x total optimizer steps)."""
    return int(math.ceil(cfg.lr_warmup_ratio * num_training_steps))


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name


def no_decay(name: str, module: nn.Module, param: torch.Tensor) -> bool:
    """True for biases and normalisation weights (and any other 1-D parameter, e.g. a scalar gate)."""
    return name.endswith("bias") or _is_norm(module) or param.ndim < 2


def param_groups(model: nn.Module, weight_decay: float, muon: bool = False) -> list[dict]:
    """Two AdamW groups: trainable parameters with `weight_decay`, and those without decay. With
    `muon`, a first group `{"muon": True}` takes the hidden layers' 2-D weights (muon.py)."""
    from rlhfkit.backend.muon import is_muon_param

    ortho, decay, skip, seen = [], [], [], set()
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if muon and is_muon_param(mod_name, module, p):
                ortho.append(p)
            else:
                (skip if no_decay(pname, module, p) else decay).append(p)
    groups = [{"params": ortho, "weight_decay": weight_decay, "muon": True},
              {"params": decay, "weight_decay": weight_decay}, {"params": skip, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _validate(cfg: OptimConfig) -> None:
    if cfg.learning_rate < 0:
        raise ValueError(f"--learning_rate must be >= 0, got {cfg.learning_rate}")
    if len(cfg.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.adam_betas):
        raise ValueError(f"--adam_betas must be two numbers in [0, 1), got {cfg.adam_betas}")
    if cfg.adam_eps <= 0:
        raise ValueError(f"--adam_eps must be > 0, got {cfg.adam_eps}")
    if cfg.l2 < 0:
        raise ValueError(f"--l2 must be >= 0, got {cfg.l2}")
    if not 0.0 <= cfg.lr_warmup_ratio <= 1.0:
        raise ValueError(f"--lr_warmup_ratio must be in [0, 1], got {cfg.lr_warmup_ratio}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ValueError(f"--min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.max_norm < 0:
        raise ValueError(f"--max_norm must be >= 0 (0 disables clipping), got {cfg.max_norm}")
    if cfg.optim not in ("adam", "muon"):
        raise ValueError(f"--optim must be adam or muon, got {cfg.optim!r}")


def build_optimizer(model: nn.Module, cfg: OptimConfig, groups: list[dict] | None = None,
                    fused: bool = False, master: Any = None) -> torch.optim.Optimizer:
    """AdamW (or, with `--optim muon`, Muon + AdamW) over `model`'s trainable parameters (build it
    after sharding the model), or over the given `groups` (e.g. fp32 master copies); `fused` picks
    the single-kernel CUDA implementation of AdamW. With `master` (the `MasterWeights` whose copies
    `groups` holds) and `fused`, AdamW is `MasterAdamW`, whose step also writes the module."""
    _validate(cfg)
    groups = param_groups(model, cfg.l2, cfg.optim == "muon") if groups is None else groups
    if not groups:
        raise ValueError("the model has no trainable parameters (requires_grad=False everywhere)")
    betas = (float(cfg.adam_betas[0]), float(cfg.adam_betas[1]))
    adamw = {"lr": cfg.learning_rate, "betas": betas, "eps": cfg.adam_eps, **({"fused": True} if fused else {})}
    if cfg.optim == "muon":
        from rlhfkit.backend.muon import build_muon

        return build_muon(groups, cfg, adamw)
    if master is not None and fused:
        from rlhfkit.backend.master_adamw import MasterAdamW

        return MasterAdamW(groups, master, **adamw)
    return torch.optim.AdamW(groups, **adamw)


def schedule_fn(cfg: OptimConfig, num_training_steps: int) -> Callable[[int], float]:
    """The factor f(step) for `--lr_scheduler`; unknown names raise naming the flag."""
    if cfg.lr_scheduler not in SCHEDULES:
        raise ValueError(f"--lr_scheduler {cfg.lr_scheduler!r} is not known; choose one of "
                         f"{', '.join(sorted(SCHEDULES))}")
    if num_training_steps < 1:
        raise ValueError(f"the number of optimizer steps must be >= 1, got {num_training_steps} "
                         "(check --train_batch_size, --max_epochs and the dataset size)")
    warm = num_warmup_steps(cfg, num_training_steps)
    return partial(_apply_schedule, SCHEDULES[cfg.lr_scheduler], warm, num_training_steps,
                   float(cfg.min_lr_ratio))


def _apply_schedule(fn: ScheduleFn, warm: int, total: int, min_ratio: float, step: int) -> float:
    return fn(step, warm, total, min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    num_training_steps: int) -> LambdaLR:
    """`LambdaLR` with the `--lr_scheduler` factor; call `.step()` once per optimizer step."""
    return LambdaLR(optimizer, schedule_fn(cfg, num_training_steps))
