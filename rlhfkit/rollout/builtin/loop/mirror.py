"""Tensor-parallel shards of the builtin engine replaying shard 0's step operations.

Every `StepRunner` operation takes host values only (step_runner.py), so it can be replayed on another
process. A tensor-parallel engine runs that way (`MirroredSteps`): the front end lives on shard 0, and before
shard 0 runs an operation it broadcasts `(name, args)` over a CPU (gloo) control group; every
other shard runs `serve()`, a loop that receives each operation and runs it on its own
`StepRunner`. The collectives inside the model (model/decoder.py) then meet in the same order on every
shard. Only `read_out` is not mirrored (shard 0 alone reads results).

    shard 0:  BuiltinEngine (requests, scheduler, completions) -> MirroredSteps -> StepRunner
                                                                   | broadcast (name, args)
    shard k:  serve(): receive -> StepRunner.<name>(*args)  ... until "shutdown"
"""

from __future__ import annotations

import logging
from typing import Any

from rlhfkit.rollout.builtin.loop.step_runner import StepRunner
from rlhfkit.rollout.builtin.model.tensor_parallel import ControlChannel, TensorParallelGroup

log = logging.getLogger(__name__)

MIRRORED = ("admit", "decode", "release", "move", "fail_all", "update_weights", "sleep", "wake_up", "warmup",
            "shutdown")


class MirroredSteps:
    """Shard 0's `StepRunner`: each mirrored operation is broadcast before it runs here."""

    def __init__(self, local: StepRunner, channel: ControlChannel) -> None:
        self.local, self.channel = local, channel

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.local, name)
        if name not in MIRRORED:
            return fn

        def mirrored(*args: Any) -> Any:
            if name == "update_weights":
                args = (list(args[0]),)  # an iterator cannot be sent twice
            with self.local.lock:  # the broadcast and the local run stay in one order across threads
                self.channel.send((name, args))
                return fn(*args)
        return mirrored


def serve(local: StepRunner, channel: ControlChannel) -> int:
    """A shard's loop (shards 1..N-1): run each operation shard 0 broadcasts until "shutdown".
    Returns the number of operations run. An operation that fails is logged and re-raised: the
    other shards then fail at their next collective instead of waiting forever."""
    count = 0
    while True:
        name, args = channel.receive()
        if name not in MIRRORED:
            raise RuntimeError(f"tensor-parallel shard received an unknown operation {name!r}")
        try:
            getattr(local, name)(*args)
        except Exception:
            log.exception("tensor-parallel shard: operation %s failed", name)
            raise
        count += 1
        if name == "shutdown":
            return count


def mirror(local: StepRunner, tp: TensorParallelGroup | None) -> StepRunner | MirroredSteps:
    """Shard 0 of a tensor-parallel engine mirrors its step operations; anything else runs them as they are."""
    if tp is None or tp.size == 1 or tp.rank != 0:
        return local
    return MirroredSteps(local, tp.control_channel)
