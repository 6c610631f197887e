"""The builtin rollout engine: slot KV cache, continuous batching, CUDA-graph decode (docs/architecture.md,
"Packages": rlhfkit.rollout).

    config.py   BuiltinEngineConfig: the engine's sizes and switches (read by the loop and the model)
    loop/       the engine loop: the front end (BuiltinEngine), the inbox, the scheduler, one engine step,
                the step runner (device side) and its decode runner, on-device sampling
    model/      the model and its weights: families, the model's spec, rotary tables, the decoder's forward
                passes, the routed experts, weights loading and layout, weights shared with a training module,
                the vision tower, tensor-parallel shard groups, whether a model is supported
    kernels/    GPU kernels the decoder calls: Triton custom ops (decode attention, sampler passes,
                GEMMs, RMSNorm, routed experts) and the torch.compile'd pieces of an eager step

Imports go one way: loop -> model -> kernels (kernels import neither).
"""

from rlhfkit.rollout.builtin.config import BuiltinEngineConfig
from rlhfkit.rollout.builtin.loop.front_end import BuiltinEngine
from rlhfkit.rollout.builtin.model.supported import builtin_support

__all__ = ["BuiltinEngine", "BuiltinEngineConfig", "builtin_support"]
