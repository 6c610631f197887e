"""`LocalGroup`: a role in this process (one process, or one torchrun rank holding its own share of
the batch), behind the `RoleGroup` contract of rlhfkit/roles/handles.py; the Ray side is
rlhfkit/distributed/group.py's `RayGroup`. Each call's device memory peak is kept per method, and an
out-of-memory inside a call becomes `RoleOutOfMemory` naming the role, rank and phase.

Weights reach the rollout engine through one weight-sync object per placement, which the loop
calls once per step (`sync() -> metrics`): rlhfkit/weightsync (`LocalWeightSync` in process,
`RayWeightSync` on Ray).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Concatenate, ParamSpec, Protocol, TypeVar

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.roles.memory import CallMemory
from rlhfkit.types import ExperienceBatch

P = ParamSpec("P")
R = TypeVar("R")


class Role(Protocol):
    """A role object (ActorRole, CriticRole, RewardModelRole, or a test's fake): the handles call its
    methods; `dist` is the rank and device it runs on."""

    dist: DistInfo


class LocalGroup:
    def __init__(self, role: Role, name: str) -> None:
        """`role`: an object with the methods the handles call."""
        self.role, self.name = role, name
        self.memory = CallMemory(name, role.dist.rank, role.dist.device)

    def on_every_rank(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        # the role's own attribute of that name: a subclass's override, or a test's fake role
        with self.memory.call(method.__name__):
            return getattr(self.role, method.__name__)(*args, **kwargs)

    def on_batch(self, method: Callable[Concatenate[Any, ExperienceBatch, P], R], batch: ExperienceBatch,
                 *args: P.args, **kwargs: P.kwargs) -> R:
        return self.on_every_rank(method, batch, *args, **kwargs)

    def states_on_device(self) -> AbstractContextManager[None]:
        return nullcontext()

    def __repr__(self) -> str:
        return f"LocalGroup({self.name})"
