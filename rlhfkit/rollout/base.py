"""The RolloutEngine protocol (docs/architecture.md, "Packages": rlhfkit.rollout).

Every engine (builtin, hf, vllm) takes token ids in and gives token ids and per-token
log-probs out. The RL loop and the agent executors only see this protocol:

    engine.generate([GenerationRequest(...)])            -> list[list[Completion]]  (n per request)
    await engine.agenerate(GenerationRequest(...))        -> list[Completion]        (n completions)
    engine.update_weights(iter((name, tensor), ...))      in place, HF parameter names
    engine.sleep() / engine.wake_up()                     free / restore GPU memory
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
