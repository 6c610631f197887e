"""How a training model is spread over ranks: process groups, the named mesh, tensor parallelism,
FSDP2 sharding and context parallelism (ring attention). Nothing here trains; `rlhfkit.backend`
builds on it, and rollout engines use its process-group layer for their own shards.

    dist.py            process groups (torchrun, Ray, or none) and `DistInfo`'s scoped reductions
    rendezvous.py      ports of the groups rlhfkit forms itself; a clean exit for gloo ranks
    mesh.py            `ParallelDims` (dp_replicate x dp_shard x cp x tp) -> DeviceMesh, `attach_mesh`
    tensor_parallel.py `apply_tp`: HF decoder layers split over the "tp" dim
    sharding.py        `apply_fsdp2` over the data-parallel dims; grad norms, full weights of DTensors
    context_parallel.py `apply_cp`: a model runs each sequence split over the "cp" ring
    ring_attention.py, ring_blocks.py, ring_layout.py   the ring attention it runs
"""

from rlhfkit.parallel.dist import DistInfo, all_reduce_sum, barrier, broadcast_object, init_distributed, is_rank0
from rlhfkit.parallel.mesh import ParallelDims, attach_mesh
from rlhfkit.parallel.apply import Parallelized, ParallelizeConfig, parallelize

__all__ = ["DistInfo", "init_distributed", "all_reduce_sum", "barrier", "broadcast_object", "is_rank0",
           "ParallelDims", "attach_mesh",
           "parallelize", "ParallelizeConfig", "Parallelized"]
