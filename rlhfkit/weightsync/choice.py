"""Choosing the transport, once: `choose_transport(--weight_sync, placement facts) -> WeightTransport`.

    object_store  as asked
    broadcast     NCCL when policy rank 0 and every engine shard are on CUDA, no shard shares rank
                  0's GPU and --vllm_sync_backend is nccl; else gloo, with the reason
    ipc           when every engine shard shares a GPU with a policy rank; else broadcast, with the reason
    auto          ipc when every engine shard shares a GPU with a policy rank, else broadcast

Engines with their own loading path (vLLM, `engine_direct` False) always use the object store.
A fallback always comes with its reason (`describe()`), which the CLI prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from rlhfkit.weightsync.broadcast import BroadcastTransport
from rlhfkit.weightsync.flags import METHODS
from rlhfkit.weightsync.ipc import IpcTransport
from rlhfkit.weightsync.object_store import ObjectStoreTransport
from rlhfkit.weightsync.protocol import WeightTransport


@dataclass(frozen=True)
class Endpoint:
    """Where an actor runs: node, Ray GPU ids (empty on CPU) and torch device."""

    node: str
    gpu_ids: tuple[str, ...]
    device: str

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def shares_gpu(self, other: "Endpoint") -> bool:
        return self.cuda and other.cuda and self.node == other.node and bool(set(self.gpu_ids) & set(other.gpu_ids))


@dataclass(frozen=True)
class Placement:
    """The facts the choice reads: where the policy ranks and engine shards run."""

    policy: Sequence[Endpoint]
    engines: Sequence[Endpoint]
    backend: str = "nccl"  # --vllm_sync_backend

    def ipc_sources(self) -> tuple[int, ...] | None:
        """Per engine shard, the policy rank on its GPU; None unless every shard has one."""
        source = tuple(next((r for r, p in enumerate(self.policy) if p.shares_gpu(e)), -1) for e in self.engines)
        return source if self.engines and all(s >= 0 for s in source) else None


def _broadcast_over(p: Placement, note: str = "") -> BroadcastTransport:
    rank0 = p.policy[0]
    if not (rank0.cuda and all(e.cuda for e in p.engines)):
        why = "gloo: the policy or an engine is on CPU" + (" (--vllm_sync_backend nccl becomes gloo)"
                                                            if p.backend == "nccl" else "")
    elif any(rank0.shares_gpu(e) for e in p.engines):
        why = "gloo: an engine shares policy rank 0's GPU (NCCL needs one GPU per rank)"
    elif p.backend == "gloo":
        why = "gloo: --vllm_sync_backend gloo"
    else:
        return BroadcastTransport("nccl", note)
    return BroadcastTransport("gloo", "; ".join(x for x in (note, why) if x))


def _object_store(p: Placement) -> WeightTransport:
    return ObjectStoreTransport()


def _broadcast(p: Placement) -> WeightTransport:
    return _broadcast_over(p)


def _ipc(p: Placement) -> WeightTransport:
    sources = p.ipc_sources()
    if sources is not None:
        return IpcTransport(sources)
    return _broadcast_over(p, "--weight_sync ipc falls back: it needs every engine on the GPU of a policy rank "
                              "(--colocate_all_models on GPUs)")


def _auto(p: Placement) -> WeightTransport:
    sources = p.ipc_sources()
    if sources is not None:
        return IpcTransport(sources, "auto: every engine shares a GPU with a policy rank")
    return _broadcast_over(p)


# --weight_sync value -> how it resolves (flags.METHODS, the flag's choices, in order)
REQUESTS: dict[str, Callable[[Placement], WeightTransport]] = dict(zip(METHODS, (_auto, _object_store, _broadcast,
                                                                                 _ipc), strict=True))


def choose_transport(requested: str, policy: Sequence[Endpoint], engines: Sequence[Endpoint], *,
                     engine_direct: bool = True, backend: str = "nccl") -> WeightTransport:
    """The transport for `--weight_sync requested` (see the module docstring). `engine_direct` is
    False for engines with their own loading path (vLLM); `backend` is --vllm_sync_backend."""
    resolve = REQUESTS.get(requested)
    if resolve is None:
        raise ValueError(f"--weight_sync {requested!r}: choose one of {', '.join(METHODS)}")
    if not engine_direct and resolve is not _object_store:
        return ObjectStoreTransport(reason=f"--weight_sync {requested} falls back: vLLM engines load "
                                           "weights through their own path")
    return resolve(Placement(policy, engines, backend))
