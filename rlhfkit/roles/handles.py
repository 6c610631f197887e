"""How the RL loop reaches a role, wherever the role lives: typed handles over a role group.

    loop ──> PolicyHandle.train_on(batch, kl_coef)            typed methods, one per role method
               └─> group.on_batch(ActorRole.train_on, batch, kl_coef)
                     LocalGroup (roles/group.py)             this process (one process, or one
                                                             torchrun rank with its own share)
                     RayGroup (distributed/group.py)         N actors: each data-parallel rank its
                                                             rows, the results merged

A group runs a role's method named by the method itself (`ActorRole.train_on`), never by a string
the loop writes, so a renamed or misspelt method is an import-time error, not a run-time one.
`on_batch` splits an `ExperienceBatch` by rows across data-parallel ranks (tensors are
concatenated back by rows, metric dicts averaged: roles already reduce them over their ranks);
`on_every_rank` runs the method on every rank with the same arguments and returns rank 0's result.

The loop's collaborators are the protocols `PolicyCalls`, `ReferenceCalls`, `CriticCalls` and
`RewardCalls`: a test passes a fake with these methods; a placement passes the handles.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Concatenate, Iterator, ParamSpec, Protocol, TypeVar

import torch

from rlhfkit.roles.actor import ActorRole
from rlhfkit.roles.critic import CriticRole, RewardModelRole
from rlhfkit.types import ExperienceBatch

P = ParamSpec("P")
R = TypeVar("R")


class RoleGroup(Protocol):
    """The ranks of one role (see the module docstring)."""

    name: str

    def on_batch(self, method: Callable[Concatenate[Any, ExperienceBatch, P], R], batch: ExperienceBatch,
                 *args: P.args, **kwargs: P.kwargs) -> R: ...

    def on_every_rank(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R: ...

    def states_on_device(self) -> AbstractContextManager[None]:
        """The role's training states on its device for the block (offloaded ones come back)."""
        ...


class PolicyCalls(Protocol):
    @property
    def name(self) -> str: ...

    def forward_logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor:
        """[B, L] per-token log-probs of `batch` (0 where masked)."""
        ...

    def train_on(self, batch: ExperienceBatch, kl_coef: float) -> dict[str, float]:
        """PPO epochs over `batch`; metrics averaged over the optimizer steps."""
        ...


class ReferenceCalls(Protocol):
    @property
    def name(self) -> str: ...

    def forward_logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor: ...


class CriticCalls(Protocol):
    @property
    def name(self) -> str: ...

    def forward_values(self, batch: ExperienceBatch) -> torch.Tensor:
        """[B, L] values of `batch`."""
        ...

    def train_on(self, batch: ExperienceBatch) -> dict[str, float]: ...


class RewardCalls(Protocol):
    @property
    def name(self) -> str: ...

    def forward_rewards(self, batch: ExperienceBatch) -> torch.Tensor:
        """[B] sequence rewards of `batch`."""
        ...


class _Handle:
    def __init__(self, group: RoleGroup) -> None:
        self.group = group

    @property
    def name(self) -> str:
        return self.group.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.group!r})"


class PolicyHandle(_Handle):
    def forward_logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor:
        return self.group.on_batch(ActorRole.forward_logprobs, batch, temperature)

    def train_on(self, batch: ExperienceBatch, kl_coef: float) -> dict[str, float]:
        return self.group.on_batch(ActorRole.train_on, batch, kl_coef)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights, tensor by tensor (a policy in this process: LocalWeightSync)."""
        return self.group.on_every_rank(ActorRole.weights)


class ReferenceHandle(_Handle):
    def forward_logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor:
        return self.group.on_batch(ActorRole.forward_logprobs, batch, temperature)


class CriticHandle(_Handle):
    def forward_values(self, batch: ExperienceBatch) -> torch.Tensor:
        return self.group.on_batch(CriticRole.forward_values, batch)

    def train_on(self, batch: ExperienceBatch) -> dict[str, float]:
        return self.group.on_batch(CriticRole.train_on, batch)


class RewardHandle(_Handle):
    def forward_rewards(self, batch: ExperienceBatch) -> torch.Tensor:
        return self.group.on_batch(RewardModelRole.forward_rewards, batch)
