"""`--optim muon`: PyTorch's Muon for the hidden layers' 2-D weights, AdamW for everything else.

Muon (momentum orthogonalised by Newton-Schulz iterations, an optimizer for hidden layers)
keeps a momentum buffer B of each weight matrix W and
steps along its orthogonalised direction:

    B <- mu B + g                       (g: the gradient; Nesterov: use g + mu B below)
    O  = NewtonSchulz_k(B)              (k = --muon_ns_steps quintic iterations ~ U V^T of B = U S V^T)
    W <- (1 - lr wd) W - lr sqrt(max(1, rows / cols)) O

`torch.optim.Muon` implements it (`--muon_lr`, `--muon_momentum`, `--muon_nesterov`, weight decay
`--l2`). It is meant for the matrices of hidden layers only, so, as is standard (and as OpenRLHF
does with DeepSpeed's Muon), embeddings, output heads (lm_head, a value head `score`), norms,
biases and any non-2-D tensor (fused MoE experts, routers) are stepped by AdamW with the Adam flags.

`MuonWithAdamW` is one `torch.optim.Optimizer` over both kinds of parameter groups (a group with
`"muon": True` is Muon's), so the backend's single optimizer, its LR schedule (each group's rate
scaled by the same factor), state dicts and torch.distributed.checkpoint work unchanged. The two
inner optimizers share the outer one's group dicts and its `state` (their parameter sets are
disjoint); `load_state_dict` re-binds them to the new dicts.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

HEAD_NAMES = frozenset({"lm_head", "score", "value_head", "v_head", "embed_out"})


def is_muon_param(module_name: str, module: nn.Module, param: torch.Tensor) -> bool:
    """True for the 2-D weight of an nn.Linear inside the network (not an output or value head)."""
    return (param.ndim == 2 and isinstance(module, nn.Linear)
            and not any(part in HEAD_NAMES for part in module_name.split(".")))


def _muon_settings(cfg: Any) -> dict[str, Any]:
    if cfg.muon_lr < 0:
        raise ValueError(f"--muon_lr must be >= 0, got {cfg.muon_lr}")
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise ValueError(f"--muon_momentum must be in [0, 1), got {cfg.muon_momentum}")
    if not 1 <= cfg.muon_ns_steps < 100:
        raise ValueError(f"--muon_ns_steps must be in [1, 99], got {cfg.muon_ns_steps}")
    return {"lr": cfg.muon_lr, "momentum": cfg.muon_momentum, "nesterov": bool(cfg.muon_nesterov),
            "ns_steps": cfg.muon_ns_steps}


class MuonWithAdamW(torch.optim.Optimizer):
    """Groups with `"muon": True` step with `torch.optim.Muon(**muon)`, the rest with
    `torch.optim.AdamW(**adamw)`; see the module docstring."""

    def __init__(self, groups: list[dict], muon: dict[str, Any], adamw: dict[str, Any]) -> None:
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(f"--optim muon needs torch.optim.Muon (PyTorch >= 2.9); this is torch {torch.__version__}")
        muon_groups = [g for g in groups if g.get("muon")]
        adam_groups = [g for g in groups if not g.get("muon")]
        self._muon = torch.optim.Muon(muon_groups, **muon) if muon_groups else None
        self._adamw = torch.optim.AdamW(adam_groups, **adamw) if adam_groups else None
        inner = [g for o in (self._muon, self._adamw) if o is not None for g in o.param_groups]
        super().__init__(inner, defaults={})
        self._bind()

    def _bind(self) -> None:
        """Point the inner optimizers at this optimizer's group dicts and state."""
        if self._muon is not None:
            self._muon.param_groups = [g for g in self.param_groups if g.get("muon")]
            self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g.get("muon")]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._bind()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in (self._muon, self._adamw):
            if opt is not None:
                opt.step()
        return loss


def build_muon(groups: list[dict], cfg: Any, adamw: dict[str, Any]) -> MuonWithAdamW:
    """The optimizer of `--optim muon` over `groups` (see `optim.param_groups(..., muon=True)`)."""
    if not any(g.get("muon") for g in groups):
        raise ValueError("--optim muon: the model has no trainable 2-D hidden-layer weight for Muon")
    return MuonWithAdamW(groups, _muon_settings(cfg), adamw)
