"""fp32 master weights held beside a low-precision module (one process, no process group).

The module's floating-point parameters are cast to the compute dtype (bf16 / fp16), so forward
and backward run natively in that dtype, with no autocast casts and a bf16 residual stream, the
same numerics as the sharded FSDP2 path (`MixedPrecisionPolicy(param_dtype=bf16)`). The optimizer
never sees those parameters: it steps fp32 copies (the "master weights" of mixed-precision
training), and after each step the copies are written back, rounded, into
the module.

Gradients: a post-accumulate-grad hook on every trainable parameter adds its low-precision
gradient into the master's fp32 `.grad` and frees it, so gradient accumulation over micro-batches
sums in fp32 and the low-precision gradient of a parameter lives only until its hook runs. With
`keep_low_grads` (set when the fused step of master_adamw.py runs), the first micro-batch's gradient
is kept as it is instead, and read by that step directly; a second micro-batch upcasts it and adds
its own in fp32, the same sums as without.

State dicts use the parameter names of the module, in the layout of
`torch.distributed.checkpoint.state_dict` (`{"state": {fqn: ...}, "param_groups": [{...,
"params": [fqn, ...]}]}`), so a checkpoint written here loads into a sharded run and back.
`live_model_state_dict` / `live_optimizer_state_dict` hand out the tensors themselves (no copy),
which `torch.distributed.checkpoint` writes from and loads into in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MasterWeights:
    """fp32 copies of the trainable parameters of `model`, which is cast to `compute_dtype`."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype) -> None:
        self.compute_dtype = compute_dtype
        self.params: list[nn.Parameter] = []  # the module's (low-precision) parameters
        self.masters: list[torch.Tensor] = []  # their fp32 copies, in the same order
        self.names: list[str] = []
        self._master_of: dict[int, torch.Tensor] = {}
        self._low_of: dict[int, nn.Parameter] = {}  # master id -> module parameter
        self._hooks = []
        self.keep_low_grads = False
        self.low_grads: list[torch.Tensor | None] = []
        for name, p in model.named_parameters():  # tied parameters appear once
            if not p.requires_grad or not p.is_floating_point():
                continue
            master = p.detach().to(torch.float32, copy=True)
            self.params.append(p)
            self.masters.append(master)
            self.names.append(name)
            self._master_of[id(p)] = master
            self._low_of[id(master)] = p
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and p.dtype != compute_dtype:
                    p.data = p.data.to(compute_dtype)
        self.low_grads = [None] * len(self.params)
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate_into(i)))

    def _accumulate_into(self, i: int):
        master = self.masters[i]

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            low = self.low_grads[i]
            if master.grad is not None:
                master.grad.add_(g)
            elif low is not None:  # a second micro-batch: the kept gradient upcast, this one added
                self.low_grads[i] = None
                master.grad = low.to(torch.float32)
                master.grad.add_(g)
            elif self.keep_low_grads:
                self.low_grads[i] = g
            else:
                master.grad = g.to(torch.float32)
            p.grad = None

        return hook

    # ------------------------------------------------------------------ kept low-precision gradients

    def current_grads(self) -> dict[int, torch.Tensor]:
        """master id -> its gradient this step: the fp32 `.grad`, or the kept low-precision one."""
        out = {}
        for m, low in zip(self.masters, self.low_grads):
            g = m.grad if m.grad is not None else low
            if g is not None:
                out[id(m)] = g
        return out

    def has_low_grads(self) -> bool:
        return any(g is not None for g in self.low_grads)

    def materialize_grads(self) -> None:
        """Kept low-precision gradients upcast into the masters' fp32 `.grad` (for torch's optimizers)."""
        for i, low in enumerate(self.low_grads):
            if low is not None:
                self.low_grads[i] = None
                self.masters[i].grad = low.to(torch.float32)

    def clear_low_grads(self) -> None:
        self.low_grads = [None] * len(self.masters)

    def grad_norm(self) -> torch.Tensor:
        """2-norm over every master's current gradient (kept ones summed in fp32), a 0-d fp32 tensor."""
        grads = list(self.current_grads().values())
        if not grads:
            return torch.zeros(())
        norms = []
        for dtype in {g.dtype for g in grads}:
            norms.extend(torch._foreach_norm([g for g in grads if g.dtype == dtype], 2, dtype=torch.float32))
        return torch.linalg.vector_norm(torch.stack(norms))

    def low_param_of(self, master: torch.Tensor) -> nn.Parameter:
        """The module parameter whose fp32 copy `master` is."""
        return self._low_of[id(master)]

    # ------------------------------------------------------------------ optimizer side

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        return self._master_of[id(p)]

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """The module's AdamW groups (see optim.param_groups) with each parameter replaced by its master."""
        return [{**g, "params": [self.master_of(p) for p in g["params"]]} for g in groups]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the module's parameters (after every optimizer step or load)."""
        if self.params:
            torch._foreach_copy_([p.data for p in self.params], self.masters)

    def to(self, device: torch.device | str) -> None:
        """Move the masters (and their gradients) keeping their identity (the optimizer holds them)."""
        for m in self.masters:
            m.data = m.data.to(device, non_blocking=True)
            if m.grad is not None:
                m.grad = m.grad.to(device, non_blocking=True)
        self.low_grads = [g.to(device, non_blocking=True) if g is not None else None for g in self.low_grads]

    # ------------------------------------------------------------------ state dicts

    def master_or_none(self, t: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master of module tensor `t`, or None when it has none (buffers, frozen weights)."""
        return self._master_of.get(id(t))

    def live_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The module's state dict with every trainable parameter replaced by its fp32 master
        (the tensors themselves: loading into them in place loads the masters)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            master = self._master_of.get(id(t))
            out[name] = (master if master is not None else t).detach()
        return out

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`live_model_state_dict` copied to CPU."""
        return {k: v.cpu() for k, v in self.live_model_state_dict(model).items()}

    @torch.no_grad()
    def load_model_state_dict(self, model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (fp32 or any dtype) into masters and module alike."""
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if k in dict(model.named_parameters())]
        if missing or unexpected:
            raise KeyError(f"checkpoint weights do not match the model: missing {missing[:5]}, "
                           f"unexpected {list(unexpected)[:5]}")
        for name, m in zip(self.names, self.masters):
            m.copy_(sd[name].to(m.device, torch.float32))
        self.copy_to_model()

    def live_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, holding the optimizer's own state tensors.

        An optimizer that has not stepped yet is given its state first (`init_optimizer_state`),
        so that there are tensors to load a checkpoint into."""
        init_optimizer_state(optimizer)
        return self._named_optimizer_state(optimizer, lambda v: v)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, copied to CPU (the DCP full-state-dict layout)."""
        return self._named_optimizer_state(optimizer, lambda v: v.detach().cpu())

    def _named_optimizer_state(self, optimizer: torch.optim.Optimizer, conv) -> dict[str, Any]:
        name_of = {id(m): n for n, m in zip(self.names, self.masters)}
        sd = optimizer.state_dict()
        order = [m for g in optimizer.param_groups for m in g["params"]]
        state = {name_of[id(order[i])]: {k: (conv(v) if isinstance(v, torch.Tensor) else v)
                                         for k, v in s.items()}
                 for i, s in sd["state"].items()}
        groups = []
        for g, sg in zip(optimizer.param_groups, sd["param_groups"]):
            groups.append({**{k: v for k, v in sg.items() if k != "params"},
                           "params": [name_of[id(m)] for m in g["params"]]})
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        name_of = {id(m): n for n, m in zip(self.names, self.masters)}
        order = [name_of[id(m)] for g in optimizer.param_groups for m in g["params"]]
        index = {n: i for i, n in enumerate(order)}
        saved_groups = sd["param_groups"]
        if [sorted(g["params"]) for g in saved_groups] != [sorted(name_of[id(m)] for m in g["params"])
                                                            for g in optimizer.param_groups]:
            raise KeyError("checkpoint optimizer groups do not match the model's trainable parameters")
        state = {index[n]: s for n, s in sd["state"].items()}
        groups = [{**{k: v for k, v in sg.items() if k != "params"}, "params": [index[n] for n in g_names]}
                  for sg, g_names in zip(saved_groups, ([name_of[id(m)] for m in g["params"]]
                                                        for g in optimizer.param_groups))]
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has not stepped: one step with zero gradients and
    learning rate 0 (AdamW then changes no weight), gradients cleared after. No-op once it has state."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params) or getattr(optimizer, "grads_pending", lambda: False)():
        raise RuntimeError("cannot initialise the optimizer state while gradients are pending")
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)

