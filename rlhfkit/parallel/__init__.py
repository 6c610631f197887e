"""How a training model is spread over ranks: process groups, the named mesh, tensor parallelism,
FSDP2 sharding and context parallelism (ring attention). Nothing here trains: `rlhfkit.backend`
builds on it, and rollout engines use its process-group layer for their own shards.

    init_distributed(device) -> DistInfo                          dist.py (ports: rendezvous.py)
    ParallelDims.from_flags(world, zero_stage, tp, cp)            mesh.py: dp_replicate x dp_shard x cp x tp
    attach_mesh(dist, dims) -> DistInfo with the DeviceMesh and its dp / loss / tp / cp groups
    parallelize(model, dims, cfg, mesh)                           apply.py, in place, in this order:
      activation checkpointing
      -> tp > 1: apply_tp over mesh["tp"]                         tensor_parallel.py
      -> torch.compile per transformer block
      -> fully_shard per block + root over the dp dims            sharding.py (cp folded into dp_shard)
      -> cp > 1: apply_cp over mesh["cp"]                         context_parallel.py -> ring_attention.py
                                                                  (ring_blocks.py, ring_layout.py)

Each file is here because it is about where tensors live across ranks: sharding.py also holds the
gradient norm and the full-weight reads of FSDP2's DTensors (the backend's optimizer step, its
full weights for weight sync, the HF export).
"""

from importlib import import_module
from typing import Any

# names -> their module, imported on first use: `import rlhfkit.parallel.dist` (every Ray actor, torchrun
# rank and engine shard) then costs the process-group layer only, not FSDP2, compile and the model loader
_LAZY = {**dict.fromkeys(("DistInfo", "init_distributed", "all_reduce_sum", "barrier", "broadcast_object", "is_rank0"),
                         "rlhfkit.parallel.dist"),
         **dict.fromkeys(("ParallelDims", "attach_mesh"), "rlhfkit.parallel.mesh"),
         **dict.fromkeys(("parallelize", "ParallelizeConfig", "Parallelized"), "rlhfkit.parallel.apply")}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
