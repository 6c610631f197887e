"""FSDP2 wrapping (per decoder block and root), global gradient norms, full-weight iteration.

`--zero_stage` on FSDP2 (`torch.distributed.fsdp.fully_shard`), on the data-parallel dims of
the mesh that `ParallelDims` (mesh.py) builds:

    3    1-D mesh ("dp_shard"=world,), reshard_after_forward=True: parameters, gradients and
         optimizer states are sharded; blocks are all-gathered again for backward.
    1/2  1-D mesh ("dp_shard"=world,), reshard_after_forward=False: gradients and optimizer states
         are sharded, the gathered parameters stay between forward and backward (no re-gather).
    0    2-D mesh ("dp_replicate"=world, "dp_shard"=1): FSDP2's hybrid mode with a shard group of
         one rank is plain replication (every rank holds full parameters, gradients and optimizer
         states; gradients are all-reduced), i.e. DDP. We use it instead of DDP /
         `_composable.replicate` so that every stage has the same DTensor parameters, the same
         gradient clipping and the same distributed state-dict code.

Gradients are *summed* over ranks (the caller's loss is already divided by the global count,
docs/architecture.md): every FSDP module gets `set_gradient_divide_factor(1.0)` and
`set_force_sum_reduction_for_comms(True)`, so collectives use plain SUM (gloo has no
PREMUL_SUM). On a torch without those methods, `sum_gradients_by_loss_scale` says the loss
must be multiplied by the world size instead.

Transformer blocks are found from the HF model's `_no_split_modules` class names (searching
wrapped models such as peft's too); failing that, the children of the first `nn.ModuleList`
named `layers`, `h`, `blocks` or `block`.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlhfkit.models.lora import lora_layers, merged_lora_weights
from rlhfkit.models.vlm import synced_name

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

_LAYER_LIST_NAMES = ("layers", "h", "blocks", "block")


def _no_split_class_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for m in model.modules():
        for n in getattr(m, "_no_split_modules", None) or []:
            names.add(n)
    return names


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one (in module order)."""
    names = _no_split_class_names(model)
    blocks = [m for m in model.modules() if names and type(m).__name__ in names]
    if blocks:
        return blocks
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES:
            return list(m)
    return []


def apply_fsdp2(model: nn.Module, mesh: DeviceMesh, zero_stage: int,
                mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """`fully_shard` each block, then the root; gradients summed over ranks. Returns `model`."""
    reshard = zero_stage == 3
    offload = offload_policy if offload_policy is not None else OffloadPolicy()  # fully_shard's default: none
    for block in find_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
    # The root's parameters (embeddings, final norm, head) are needed right away by backward,
    # so they are never resharded after forward (they are resharded after backward).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)
    return model


def sum_gradients_by_loss_scale(model: nn.Module) -> bool:
    """Make FSDP sum gradients over ranks. False when torch lacks the API (scale the loss)."""
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not all(hasattr(m, "set_gradient_divide_factor") for m in mods):
        return False
    for m in mods:
        m.set_gradient_divide_factor(1.0)
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    return True


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective over its mesh); plain tensors unchanged."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _by_mesh(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by DTensor mesh (plain tensors together): under tensor parallelism the
    TP-split weights live on the (dp, tp) mesh and the replicated ones (norms) on the dp mesh, and
    one foreach / stack op cannot mix meshes."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def global_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """2-norm of all gradients over all ranks (DTensor shards reduced over their mesh)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = [full(torch.nn.utils.get_total_norm(g, norm_type=2.0)).float() for g in _by_mesh(grads)]
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_grads(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients by min(1, max_norm / (total_norm + 1e-6))."""
    with_grad = [p for p in params if p.grad is not None]
    for group in _by_mesh(with_grad):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)


def iter_full_params(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) one at a time, for weight sync (which buckets them: rlhfkit/weightsync); a
    peft LoRA model gives its base model's names with the adapters merged (models/lora.py
    `merged_lora_weights`).

    Every rank must iterate to the end (each DTensor is all-gathered). Names are the module's
    (HF names for an HF model); tied parameters appear once. `dtype` casts (e.g. to the
    engine's bf16) right after gathering. A vision tower frozen by --freeze_visual_encoder is left
    out (`rlhfkit.models.vlm.synced_name`): it never changes, and the engines loaded it.
    """
    keep = synced_name(model)

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in model.named_parameters():
            if keep(name):
                yield name, full(p.detach())

    named: Iterable[tuple[str, torch.Tensor]] = gathered()
    layers = lora_layers(model)
    if layers:  # a LoRA policy: the engine gets the base model's names, each adapter merged in
        named = merged_lora_weights(named, layers)
    return ((n, t.to(dtype) if dtype is not None and t.dtype != dtype else t) for n, t in named)
