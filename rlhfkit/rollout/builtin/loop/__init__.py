"""The builtin engine's loop: requests in, completions out.

    front_end.py      BuiltinEngine: the RolloutEngine protocol, sync and async; pause/resume, weight updates
    inbox.py          requests from any thread, taken by the engine's worker thread
    scheduler.py      continuous batching policy (slots, admission, buckets, compaction); pure Python
    engine_loop.py    EngineLoop.step: schedule -> run -> postprocess
    step_runner.py    the device side (StepRunner): host-valued operations a tensor-parallel engine mirrors
    mirror.py         a tensor-parallel engine's shards replaying shard 0's step operations
    decode_runner.py  one decode step: eager, torch.compile'd, CUDA graphs per bucket; fallbacks
    sampling.py       per-slot device state; temperature / top-k / top-p / min-new sampling + log-probs
"""
