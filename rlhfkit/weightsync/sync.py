"""The loop's weight-sync object, one per placement: `sync() -> metrics`, once per step.

    LocalWeightSync   the policy's full weights (`policy.weights()`, FSDP2-gathered per tensor)
                      straight into the in-process engine (those it shares with the policy: none)
    RayWeightSync     the policy ranks into every engine shard through a `WeightTransport`:
      engines.before_update(); engines.updating():   wait for the batch being generated, or under
                                                     --partial_rollout pause the engines at a step
                                                     boundary (generations in flight continue with
                                                     the new weights)
        policy.states_on_device():                   (--deepspeed_enable_sleep: reloaded if offloaded)
          policy.push_weights(dtype, bucket_bytes)   every rank gathers; the transport's senders
                                                     bucket (`buckets.iter_buckets`) and send
        transport.collect(pushed, engines)           tensors each engine shard loaded; they must agree
      the policy version goes up by one and the engines resume with it

Metrics of a Ray sync: `time/weight_push`, `weight_sync_mb`, `weight_sync/<transport name>` = 1.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Iterable, Protocol

import torch

from rlhfkit.weightsync.protocol import EngineShards, PushStats, WeightTransport


class WeightSync(Protocol):
    def sync(self) -> dict[str, float]:
        """Push the policy's current weights into the engines; metrics of the push."""
        ...


class LocalPolicy(Protocol):
    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The full weights, tensor by tensor (roles.handles.PolicyHandle)."""
        ...


class LocalEngine(Protocol):
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class LocalWeightSync:
    """The policy's full weights (`role.weights()`, FSDP2-gathered per tensor) into the in-process engine.

    `shared`: normalized names of the tensors the engine shares with the policy (the engine serves the
    policy's own storage, `--engine_weights shared`): not copied; the engine still counts a new version.
    `complete`: the engine shares every weight (a LoRA policy's adapters included): only the first tensor
    is read, for the policy's check of its weights that precedes it (non-finite or diverged: raises)."""

    def __init__(self, policy: LocalPolicy, engine: LocalEngine, shared: frozenset[str] = frozenset(),
                 complete: bool = False) -> None:
        self.policy, self.engine, self.shared, self.complete = policy, engine, shared, complete

    def sync(self) -> dict[str, float]:
        t0 = time.perf_counter()
        named = iter(self.policy.weights())
        if self.complete:
            next(named, None)
            named = iter(())
        elif self.shared:
            from rlhfkit.rollout.builtin.model.weights import normalized_name

            named = ((n, t) for n, t in named if normalized_name(n) not in self.shared)
        self.engine.update_weights(named)
        return {"time/weight_push": time.perf_counter() - t0}


class PolicyRanks(Protocol):
    """The policy's Ray group as a sync sees it (RayGroup)."""

    def states_on_device(self) -> AbstractContextManager[None]: ...

    def push_weights(self, dtype: str | None, bucket_bytes: int) -> list[PushStats]:
        """Every rank pushes (`RoleWorker.push_weights`); one record per rank."""
        ...


class RayWeightSync:
    def __init__(self, policy: PolicyRanks, engines: EngineShards, transport: WeightTransport, dtype: str | None,
                 bucket_bytes: int) -> None:
        self.policy, self.engines, self.transport = policy, engines, transport
        self.dtype, self.bucket_bytes = dtype, bucket_bytes

    def sync(self) -> dict[str, float]:
        self.engines.before_update()
        with self.engines.updating():
            t0 = time.perf_counter()
            with self.policy.states_on_device():
                pushed = self.policy.push_weights(self.dtype, self.bucket_bytes)
            counts = self.transport.collect(pushed, self.engines)
            if len(set(counts)) > 1:
                raise RuntimeError(f"engine shards loaded different numbers of tensors ({self.transport.name}): "
                                   f"{counts}")
            nbytes = max(p.bytes for p in pushed)
            return {"time/weight_push": time.perf_counter() - t0, "weight_sync_mb": nbytes / 2**20,
                    f"weight_sync/{self.transport.name}": 1.0}
