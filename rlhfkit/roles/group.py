"""Role groups: how the RL loop calls a role, wherever the role lives.

The loop only ever writes `group.call("forward_logprobs", batch)`. A `LocalGroup` holds one
in-process role (one process, or one torchrun rank, each rank holding its own share of the
batch). The Ray group in `rlhfkit.distributed` holds N actors and splits the batch across them.

Weights reach the rollout engine through one weight-sync object per placement, which the loop
calls once per step (`sync() -> metrics`): rlhfkit/weightsync (`LocalWeightSync` in process,
`RayWeightSync` on Ray).
"""

from __future__ import annotations

from typing import Any

from rlhfkit.roles.memory import CallMemory


class LocalGroup:
    def __init__(self, role: Any, name: str) -> None:
        self.role, self.name = role, name
        dist = getattr(role, "dist", None)
        self.memory = CallMemory(name, getattr(dist, "rank", 0), getattr(dist, "device", "cpu"))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self.memory.call(method):
            return getattr(self.role, method)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LocalGroup({self.name})"

