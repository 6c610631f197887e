"""Training backends: the `TrainBackend` protocol, FSDP2 (default), optimizer and LR schedules,
checkpoints and HF export.

    dist = init_distributed(backend_cfg.device)
    dims = ParallelDims.from_flags(dist.world_size, backend_cfg.zero_stage)   # the training mesh
    backend = FSDP2Backend(model, backend_cfg, optim_cfg, num_training_steps, dist, parallel=dims)
"""

from rlhfkit.backend.base import TrainBackend
from rlhfkit.backend.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rlhfkit.backend.dist import (
    DistInfo,
    all_reduce_sum,
    barrier,
    broadcast_object,
    init_distributed,
    is_rank0,
)
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.backend.parallel import ParallelDims
from rlhfkit.backend.optim import SCHEDULES, build_optimizer, build_scheduler

__all__ = [
    "TrainBackend", "FSDP2Backend", "ParallelDims", "DistInfo", "init_distributed", "all_reduce_sum", "barrier",
    "broadcast_object", "is_rank0", "build_optimizer", "build_scheduler", "SCHEDULES",
    "save_checkpoint", "load_checkpoint", "latest_checkpoint",
]
