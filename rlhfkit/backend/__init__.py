"""Training backends: the `TrainBackend` protocol, FSDP2 (default), optimizers and LR schedules,
mixed precision, EMA, the non-finite guard, and sleep (offloading a backend's states to the host).
The mesh and parallelism it trains under are `rlhfkit.parallel`; checkpoints and HF export are
`rlhfkit.checkpoint`.

    dist = init_distributed(backend_cfg.device)                                # rlhfkit.parallel
    dims = ParallelDims.from_flags(dist.world_size, backend_cfg.zero_stage)   # the training mesh
    backend = FSDP2Backend(model, backend_cfg, optim_cfg, num_training_steps, dist, parallel=dims)
"""

from rlhfkit.backend.base import TrainBackend
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.backend.optim import SCHEDULES, build_optimizer, build_scheduler

__all__ = ["TrainBackend", "FSDP2Backend", "build_optimizer", "build_scheduler", "SCHEDULES"]
