"""Role groups: how the RL loop calls a role, wherever the role lives.

The loop only ever writes `group.call("forward_logprobs", batch)`. A `LocalGroup` holds one
in-process role (one process, or one torchrun rank, each rank holding its own share of the
batch). The Ray group in `rlhfkit.distributed` holds N actors and splits the batch across them.
"""

from __future__ import annotations

from typing import Any


class LocalGroup:
    def __init__(self, role: Any, name: str) -> None:
        self.role, self.name = role, name

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, method)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LocalGroup({self.name})"
