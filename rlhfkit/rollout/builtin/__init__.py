"""The builtin rollout engine: slot KV cache, continuous batching, CUDA-graph decode (docs/architecture.md, "Packages": rlhfkit.rollout).

    weights.py   HF config/state dict -> ModelSpec + fused engine weights; HF name -> tensor view
    model.py     functional prefill / decode over the slot KV cache
    sampling.py  per-slot device state; temperature / top-k / top-p / min-new sampling + log-probs
    scheduler.py continuous batching policy (slots, admission, buckets, compaction)
    runner.py    decode step: eager, torch.compile'd, CUDA graphs per bucket; fallbacks
    triton_ops.py GPU kernels (custom ops): fused RoPE + K/V write + GQA decode attention; one-pass sampler
    step.py      the device side (StepRunner): host-valued operations a tensor-parallel engine mirrors
    tp.py        tensor-parallel shard groups, per-shard weight loading, mirroring
    config.py    BuiltinEngineConfig
    engine.py    BuiltinEngine: the RolloutEngine protocol, sync and async (the front end)
    support.py   builtin_support(config): whether the engine can run a model (its own checks, from the config)
"""

from rlhfkit.rollout.builtin.engine import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.builtin.support import builtin_support

__all__ = ["BuiltinEngine", "BuiltinEngineConfig", "builtin_support"]
