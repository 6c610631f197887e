"""Sleep and wake of a training backend's states (`offload_states` / `reload_states`,
--deepspeed_enable_sleep): `StateOffloader`, owned by FSDP2Backend, decides which tensors move and
which are rebuilt, and keeps the host stash they go to (offload.py).

    backend.offloader = StateOffloader(model, master, optimizer, device, is_sharded, on_host)
    offloader.offload()   reshard (FSDP2), then parameters, gradients, fp32 masters and Adam states
                          -> host slots; bf16 copies of masters are freed, not copied
    offloader.reload()    back, bit for bit; bf16 parameters rebuilt from their masters
    offloader.wake()      reload if asleep (readers of the states call it first)
"""

from __future__ import annotations

import torch
from torch import nn

from rlhfkit.backend.master import MasterWeights
from rlhfkit.backend.offload import HostStash, MoveStats, Named, _local


class StateOffloader:
    """See the module docstring. `on_host`: the optimizer states already live in host memory (FSDP2's
    CPUOffloadPolicy under --adam_offload on CUDA): offloading is a no-op."""

    def __init__(self, model: nn.Module, master: MasterWeights | None, optimizer: torch.optim.Optimizer | None,
                 device: torch.device, is_sharded: bool, on_host: bool = False) -> None:
        self.model, self.master, self.optimizer = model, master, optimizer
        self.device, self.is_sharded, self.on_host = device, is_sharded, on_host
        self.stash = HostStash(device)

    @property
    def asleep(self) -> bool:
        return self.stash.offloaded

    def _sleep_tensors(self) -> tuple[Named, Named]:
        """(tensors to copy out, tensors to free and rebuild) for offload_states, by stable name.

        Copied: parameters (FSDP2: the sharded DTensors; fp32 masters where the module is a bf16
        copy of them), gradients that exist, optimizer states. Rebuilt, not copied: the bf16
        module parameters that have fp32 masters (after every step and load they equal the
        masters rounded, `MasterWeights.copy_to_model`). Not moved at all: what FSDP2 frees after
        resharding (the gathered bf16 parameters) and gradients that are None after a step."""
        if self.master is not None:
            self.master.materialize_grads()  # kept bf16 gradients travel as the masters' .grad
        names = self._optimized_names()
        rebuilt = {id(p) for p in self.master.params} if self.master is not None else set()
        keep: list[tuple[str, torch.Tensor | None]] = []
        drop: list[tuple[str, torch.Tensor | None]] = []
        for n, p in self.model.named_parameters():
            (drop if id(p) in rebuilt else keep).append((f"param:{n}", p))
            keep.append((f"grad:{n}", p.grad))
        if self.master is not None:
            for n, m in zip(self.master.names, self.master.masters):
                keep.append((f"master:{n}", m))
                keep.append((f"master_grad:{n}", m.grad))
        if self.optimizer is not None:
            for p, state in self.optimizer.state.items():  # keys as _future_states reserves them
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        keep.append((f"opt:{names.get(id(p), id(p))}:{k}", v))
        return keep, drop

    def _optimized_names(self) -> dict[int, str]:
        """id -> name of every tensor the optimizer may hold state for: module parameters and fp32 masters."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        if self.master is not None:
            names.update({id(m): n for n, m in zip(self.master.names, self.master.masters)})
        return names

    def offload(self) -> MoveStats:
        """Training states into host buffers allocated once (pinned on CUDA); see offload.py.

        No-op under `--adam_offload` on CUDA (FSDP2 keeps those states in host memory already).
        On CPU the round trip still runs (it frees nothing there) so that CPU runs exercise it."""
        if self.stash.offloaded or self.on_host:
            return MoveStats()
        if self.is_sharded:
            from torch.distributed.fsdp import FSDPModule

            for m in self.model.modules():  # a no-grad forward at zero_stage < 3 leaves blocks gathered
                if isinstance(m, FSDPModule):
                    m.reshard()
        keep, drop = self._sleep_tensors()
        return self.stash.offload(keep, drop, self._future_states())

    def _future_states(self) -> list[tuple[str, int]]:
        """(key, bytes) of the Adam states that do not exist yet (before the optimizer's first step):
        the first offload reserves their host slots, so that the offload after the first training
        step does not allocate and pin twice the parameters' bytes on the host (measured at 7B: 8.9 s
        for 14 GiB a GPU, against 0.7 s to copy into slots that exist). Same keys and sizes as
        `_sleep_tensors` gives the states once they exist (`zeros_like` of the parameter)."""
        opt = self.optimizer
        if opt is None or not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            return []
        names = self._optimized_names()
        out: list[tuple[str, int]] = []
        for group in opt.param_groups:
            moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
            for p in group["params"]:
                local = _local(p)
                frozen = isinstance(p, torch.nn.Parameter) and not p.requires_grad  # (fp32 masters are plain tensors)
                if frozen or opt.state.get(p) or local.device != self.device or local.numel() == 0:
                    continue
                name = names.get(id(p), id(p))
                out.extend((f"opt:{name}:{k}", local.numel() * local.element_size()) for k in moments)
                out.append((f"opt:{name}:step", 4))  # fp32 scalar (unused where torch keeps it on the host)
        return out

    def wake(self) -> None:
        """Readers of the states (state dicts, weight iteration, saving) reload them first: asleep,
        their storages are empty. (Forward passes are the caller's: Phases reloads before a call.)"""
        if self.stash.offloaded:
            self.reload()

    def reload(self) -> MoveStats:
        """Back onto the device, bit for bit; bf16 parameters are rebuilt from their fp32 masters."""
        return self.stash.reload(self.master.copy_to_model if self.master is not None else None)

    @property
    def stats(self) -> dict[str, float]:
        """The last offload / reload: seconds and bytes (the RL loop logs them)."""
        a, b = self.stash.last_offload, self.stash.last_reload
        return {"offload_s": a.seconds, "offload_bytes": float(a.nbytes),
                "reload_s": b.seconds, "reload_bytes": float(b.nbytes)}
