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

from rlhfkit.parallel.dist import DistInfo, all_reduce_sum, barrier, broadcast_object, init_distributed, is_rank0
from rlhfkit.parallel.mesh import ParallelDims, attach_mesh
from rlhfkit.parallel.apply import Parallelized, ParallelizeConfig, parallelize

__all__ = ["DistInfo", "init_distributed", "all_reduce_sum", "barrier", "broadcast_object", "is_rank0",
           "ParallelDims", "attach_mesh",
           "parallelize", "ParallelizeConfig", "Parallelized"]
