"""The router load-balancing loss of mixture-of-experts models (`--aux_loss_coef`).

Hugging Face MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) return `aux_loss` when called
with `output_router_logits=True`: the Switch Transformer balance loss (as Mixtral's) over
the layers' router logits,

    aux = E * sum_e f_e * P_e

with E experts, f_e the fraction of token-to-expert assignments (top-k) that go to expert e and
P_e the mean router probability of e. It is minimal when the load is uniform.

`RouterAuxLoss(model, enabled)` is a `with` block around the forward passes of one micro-batch:
it asks `model` for the router logits (a forward pre-hook adds `output_router_logits=True`) and
collects the `aux_loss` of each forward (a forward hook), so the loss code and the tasks stay as
they are. `take()` gives the mean over the block's forwards, or None when the model returned none
(a dense model, or a value model whose forward returns values only); the caller then prints one
note that the flag has no effect. rlhfkit.losses.aux weights it into the step's loss.
"""

from __future__ import annotations

from typing import Any

import torch


def has_router(model: torch.nn.Module) -> bool:
    """Whether `model`'s config has the router-logits switch of transformers' MoE models."""
    return hasattr(getattr(model, "config", None), "output_router_logits")


class RouterAuxLoss:
    """Collects the `aux_loss` of every forward of `model` inside the `with` block (if `enabled`)."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True) -> None:
        self.model = model
        self.enabled = enabled and has_router(model)
        self.values: list[torch.Tensor] = []
        self._handles: list[Any] = []

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "output_router_logits": True}

    def _post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        aux = getattr(output, "aux_loss", None)
        if aux is None and isinstance(output, dict):
            aux = output.get("aux_loss")
        if isinstance(aux, torch.Tensor):
            self.values.append(aux)

    def __enter__(self) -> "RouterAuxLoss":
        if self.enabled:
            self._handles = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                             self.model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> torch.Tensor | None:
        """Mean aux loss of the forwards since the last `take` (None if none returned one)."""
        if not self.values:
            return None
        out = torch.stack([v.float() for v in self.values]).mean()
        self.values = []
        return out
