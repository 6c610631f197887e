"""`parallelize(model, dims, cfg, mesh)`: the one place parallelism is applied to a training model.

    model (HF causal LM or value model, parameters already in their dtypes)
      |  1. activation checkpointing (cfg.activation_checkpointing; HF's own, non-reentrant)
      |  2. tp > 1: apply_tp over mesh["tp"] (tensor_parallel.py); else, with cfg.fuse_qkv: one GEMM
      |     for k and v (models/fused_qkv.py; the TP plan shards k_proj and v_proj apart)
      |  3. cfg.compile: torch.compile each transformer block
      |  4. mesh given: fully_shard each block + root over the data-parallel dims, cp folded into
      |     dp_shard (sharding.py, context_parallel.fsdp_mesh); buffers to the device
      |  5. cp > 1: apply_cp: ring attention over mesh["cp"] (context_parallel.py)
      v
    Parallelized(model, context_parallel, loss_multiplier)

Without a mesh (one process, no process group) steps 4 and 5 are skipped and the caller places the
module (rlhfkit.backend: device, master weights or autocast).

Order. TP comes before compile and FSDP2: FSDP2 shards the TP DTensors over the dp dims (2-D
parameters), and compile runs before sharding so FSDP2's hooks stay outside the compiled graphs.
Activation checkpointing comes first, before TP rather than after it: that is where the backend
always enabled it, and the two commute (HF's switch only flags the decoder blocks and turns off
the KV cache; TP swaps parameters and adds hooks on the projections). Ring attention is installed
last, on the FSDP2-wrapped root, as the backend always did: it replaces the attention function and
wraps the root's forward (split before, gather after), and touches no parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlhfkit.config.configs import BackendFlags
from rlhfkit.config.declare import default_of
from rlhfkit.models.fused_qkv import fuse_qkv
from rlhfkit.models.loader import enable_gradient_checkpointing
from rlhfkit.parallel.context_parallel import ContextParallel, apply_cp
from rlhfkit.parallel.context_parallel import fsdp_mesh as fsdp_mesh_of
from rlhfkit.parallel.mesh import ParallelDims
from rlhfkit.parallel.sharding import apply_fsdp2, find_blocks, sum_gradients_by_loss_scale
from rlhfkit.parallel.tensor_parallel import apply_tp


@dataclass(frozen=True)
class ParallelizeConfig:
    """What `parallelize` applies besides the mesh sizes (the backend fills it from its flags).

    mp_policy / offload: FSDP2's MixedPrecisionPolicy and CPUOffloadPolicy (None: none)."""

    zero_stage: int = default_of(BackendFlags, "zero_stage")  # --zero_stage: reshard after forward only at 3
    activation_checkpointing: bool = False      # --gradient_checkpointing, for a model that trains
    compile: bool = False                       # --torch_compile
    compile_dynamic: bool | None = None         # torch.compile's `dynamic`
    fuse_qkv: bool = False                      # one k/v GEMM when tp == 1 (the backend: on CUDA)
    ring_head_stride: int | None = None         # --ring_head_stride
    device: str = "cpu"
    mp_policy: Any = None
    offload: Any = None


@dataclass
class Parallelized:
    """The model after `parallelize` (the same module, changed in place), its ring-attention
    splitter (cp > 1), and the factor the loss must be multiplied by so gradients are summed over
    ranks (1.0 unless the torch in use cannot make FSDP2 reduce with a plain SUM; sharding.py)."""

    model: nn.Module
    context_parallel: ContextParallel | None = None
    loss_multiplier: float = 1.0


def compile_blocks(model: nn.Module, dynamic: bool | None = None) -> None:
    """torch.compile every transformer block in place (`--torch_compile`); `dynamic` as torch.compile's."""
    from rlhfkit.compile_cache import use_persistent_cache

    blocks = find_blocks(model)
    if not blocks:
        raise ValueError("--torch_compile: no transformer blocks found in the model")
    use_persistent_cache()
    for block in blocks:
        block.compile(dynamic=dynamic)


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelizeConfig,
                mesh: DeviceMesh | None = None) -> Parallelized:
    """Apply activation checkpointing, TP, compile, FSDP2 and ring attention to `model`, in place,
    in the order of the module docstring. `mesh`: the named mesh of `dims` (None: one process).

    A model built on the meta device (`load_causal_lm(defer_weights=True)`) gets its checkpoint
    streamed into its shards after sharding (rlhfkit.models.stream_load); without a mesh the caller
    does that when it places the module."""
    from rlhfkit.models.stream_load import has_pending_weights, materialize, stream_plan

    plan = stream_plan(model) if mesh is not None and has_pending_weights(model) else None  # before TP / FSDP2
    if (cfg.activation_checkpointing and hasattr(model, "gradient_checkpointing_enable")
            and not getattr(model, "is_gradient_checkpointing", False)):  # the loader's choice of reentrant stays
        enable_gradient_checkpointing(model, use_reentrant=False, need_input_grads=False)
    if dims.tp > 1:
        if mesh is None:
            raise ValueError(f"parallelize: tensor parallelism over {dims.tp} ranks needs their device mesh")
        apply_tp(model, mesh["tp"])
    elif cfg.fuse_qkv:
        fuse_qkv(model)
    if cfg.compile:
        compile_blocks(model, cfg.compile_dynamic)
    if mesh is None:
        return Parallelized(model)
    fsdp_mesh = fsdp_mesh_of(mesh, dims)  # dp dims, with cp folded into dp_shard
    apply_fsdp2(model, fsdp_mesh, cfg.zero_stage, cfg.mp_policy, cfg.offload)
    if plan is not None:  # each rank reads its shards' rows; buffers as below
        materialize(model, "cpu" if cfg.offload is not None else cfg.device, plan)
    elif cfg.offload is None:
        model.to(torch.device(cfg.device))  # buffers not managed by FSDP (e.g. rotary tables)
    multiplier = 1.0 if sum_gradients_by_loss_scale(model) else float(fsdp_mesh.size())
    cp = apply_cp(model, mesh.get_group("cp"), cfg.ring_head_stride) if dims.cp > 1 else None
    return Parallelized(model, cp, multiplier)
