"""AdamW with decay / no-decay parameter groups, and learning-rate schedules by name.

Optimizer: AdamW (Adam with weight decay decoupled from the gradient step) with
`--learning_rate`, `--adam_betas`, `--adam_eps` and weight decay `--l2`. Biases and the weights
of normalisation layers (LayerNorm, RMSNorm, ...) get no decay. `--optim muon` steps the hidden
layers' 2-D weights with Muon instead (muon.py; `--muon_lr`, same decay `--l2`). `--optim adamw_8bit`
keeps AdamW's moments in 8 bits, `--master_weights bf16_stochastic | bf16_kahan` bf16 weights without
fp32 masters (lean_adamw.py).

Schedules (`--lr_scheduler`): `transformers.get_scheduler`, the schedules Hugging Face's Trainer,
TRL and OpenRLHF use, with W = ceil(--lr_warmup_ratio * total) warm-up steps over `total` optimizer
steps; `cosine_with_min_lr` and `cosine_warmup_with_min_lr` end at --min_lr_ratio of the peak.
Warm-up starts at a factor of 0 at the first optimizer step, as in those libraries: that step
trains at a learning rate of 0, and the backend says so in one line (fsdp2.py). The schedules are
`LambdaLR`s whose `state_dict()` keeps only the step counters, which load under
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from rlhfkit.config.configs import OptimConfig
from rlhfkit.backend.lean_adamw import WEIGHT_MODES
from rlhfkit.config.flags import LR_SCHEDULES

SCHEDULES = LR_SCHEDULES  # transformers.SchedulerType names that --lr_scheduler accepts
MIN_LR_SCHEDULES = ("cosine_with_min_lr", "cosine_warmup_with_min_lr")


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
    if cfg.optim not in ("adam", "adamw_8bit", "muon"):
        raise ValueError(f"--optim must be adam, adamw_8bit or muon, got {cfg.optim!r}")
    if cfg.master_weights not in WEIGHT_MODES:
        raise ValueError(f"--master_weights must be one of {', '.join(WEIGHT_MODES)}, got {cfg.master_weights!r}")
    if cfg.optim == "muon" and cfg.master_weights != "fp32":
        raise ValueError(f"--master_weights {cfg.master_weights} needs --optim adam or adamw_8bit (muon steps fp32 "
                         "master weights)")


def build_optimizer(model: nn.Module, cfg: OptimConfig, groups: list[dict] | None = None,
                    fused: bool = False, master: Any = None, seed: int = 0) -> torch.optim.Optimizer:
    """AdamW (or, with `--optim muon`, Muon + AdamW) over `model`'s trainable parameters (build it
    after sharding the model), or over the given `groups` (e.g. fp32 master copies); `fused` picks
    torch's single-kernel implementation of AdamW (CUDA or CPU). With `master` (the `MasterWeights` whose copies
    `groups` holds) and `fused`, AdamW is `MasterAdamW`, whose step also writes the module. `--optim adamw_8bit`
    or `--master_weights bf16_*` give `LeanAdamW` (lean_adamw.py; `seed` seeds its stochastic rounding)."""
    _validate(cfg)
    groups = param_groups(model, cfg.l2, cfg.optim == "muon") if groups is None else groups
    if not groups:
        raise ValueError("the model has no trainable parameters (requires_grad=False everywhere)")
    betas = (float(cfg.adam_betas[0]), float(cfg.adam_betas[1]))
    adamw = {"lr": cfg.learning_rate, "betas": betas, "eps": cfg.adam_eps, **({"fused": True} if fused else {})}
    if cfg.optim == "muon":
        from rlhfkit.backend.muon import build_muon

        return build_muon(groups, cfg, adamw)
    if cfg.optim == "adamw_8bit" or cfg.master_weights != "fp32":  # lean_adamw.py
        from rlhfkit.backend.lean_adamw import LeanAdamW

        return LeanAdamW(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_eps,
                         eight_bit=cfg.optim == "adamw_8bit", weights=cfg.master_weights, seed=seed)
    if master is not None and fused:
        from rlhfkit.backend.master_adamw import MasterAdamW

        return MasterAdamW(groups, master, **adamw)
    return torch.optim.AdamW(groups, **adamw)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    num_training_steps: int) -> LambdaLR:
    """`transformers.get_scheduler(--lr_scheduler)` over `num_training_steps`; call `.step()` once per
    optimizer step. Unknown names raise naming the flag."""
    from transformers import get_scheduler

    if cfg.lr_scheduler not in SCHEDULES:
        raise ValueError(f"--lr_scheduler {cfg.lr_scheduler!r} is not known; choose one of {', '.join(SCHEDULES)}")
    if num_training_steps < 1:
        raise ValueError(f"the number of optimizer steps must be >= 1, got {num_training_steps} "
                         "(check --train_batch_size, --max_epochs and the dataset size)")
    extra = {"min_lr_rate": float(cfg.min_lr_ratio)} if cfg.lr_scheduler in MIN_LR_SCHEDULES else None
    return get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=num_warmup_steps(cfg, num_training_steps),
                         num_training_steps=num_training_steps, scheduler_specific_kwargs=extra)
