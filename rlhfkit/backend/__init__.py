"""Training backends: the `TrainBackend` protocol, FSDP2 (default), optimizers and LR schedules,
mixed precision, EMA, the non-finite guard, and sleep (offloading a backend's states to the host).
The mesh and parallelism it trains under are `rlhfkit.parallel`; checkpoints and HF export are
`rlhfkit.checkpoint`.

    dist = init_distributed(backend_cfg.device)                                # rlhfkit.parallel
    dims = ParallelDims.from_flags(dist.world_size, backend_cfg.zero_stage)   # the training mesh
    backend = FSDP2Backend(model, backend_cfg, optim_cfg, num_training_steps, dist, parallel=dims)
"""

from importlib import import_module
from typing import Any

# imported on first use, so that `import rlhfkit.backend.<module>` does not load FSDP2 and DTensor
_LAZY = {"TrainBackend": "rlhfkit.backend.base", "FSDP2Backend": "rlhfkit.backend.fsdp2",
         **dict.fromkeys(("build_optimizer", "build_scheduler", "SCHEDULES"), "rlhfkit.backend.optim")}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
