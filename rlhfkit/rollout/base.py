"""The RolloutEngine protocol (docs/architecture.md, "Packages": rlhfkit.rollout).

Every engine (builtin, hf, vllm) takes token ids in and gives token ids and per-token
log-probs out. The RL loop and the agent executors only see this protocol:

    engine.generate([GenerationRequest(...)])            -> list[list[Completion]]  (n per request)
    await engine.agenerate(GenerationRequest(...))        -> list[Completion]        (n completions)
    engine.update_weights(iter((name, tensor), ...))      in place, HF parameter names
    engine.sleep() / engine.wake_up()                     free / restore GPU memory

What only some engines can do is a protocol of its own, checked once where it is used:
`VersionedEngine` (pause between steps, tag tokens with the policy's weight version: partial
rollout), `SliceLoadingEngine` (a tensor-parallel shard keeps its slices of full tensors) and
`ClosableEngine`.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch

from rlhfkit.types import Completion, GenerationRequest


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Blocking batch generation: one list of `params.n` completions per request."""
        ...

    async def agenerate(self, request: GenerationRequest) -> list[Completion]:
        """Async generation of one request; concurrent calls share the engine's batch."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full (unsharded) weights, named as in the HF model, into the engine in place."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and also the weights (level 2)."""
        ...

    def wake_up(self) -> None:
        ...


@runtime_checkable
class VersionedEngine(Protocol):
    """An engine that stops between steps and knows which policy version its weights are (the builtin one)."""

    def pause(self) -> None:
        """Stop at the next step boundary; requests in flight keep their KV cache."""
        ...

    def resume(self, version: int | None = None) -> None:
        """Continue; later tokens carry policy `version` (when given)."""
        ...

    def set_policy_version(self, version: int) -> None: ...


@runtime_checkable
class SliceLoadingEngine(Protocol):
    """An engine (or a tensor-parallel shard of one) that loads its own slices of full HF-named tensors."""

    def update_weights_local(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The number of names loaded; the caller sets the policy version when all are."""
        ...

    def serve(self) -> int:
        """Shards 1..N-1: run shard 0's steps until it closes."""
        ...


@runtime_checkable
class ClosableEngine(Protocol):
    def close(self) -> None: ...
