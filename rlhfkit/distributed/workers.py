"""Ray actor bodies: one rank of a role group (`RoleWorker`) and one rollout engine (`EngineWorker`).

Both are plain classes, made remote by the launcher (`ray.remote(RoleWorker).options(...)`), and
both take a *builder* callable from the CLI, so this package never reads the flag namespace:

    RoleWorker(role, rank, world_size, build)      build(role, DistInfo) -> (role object, backend | None)
      .setup(master_addr, master_port, device)     env RANK/WORLD_SIZE/MASTER_* -> init_distributed
                                                   (gloo on CPU, NCCL + gloo on GPU) -> build
      .call(method, *args)                         role.forward_logprobs / train_on / forward_values ...
      .init_weight_sync(sender) / .push_weights(dtype, bucket_bytes)
                                                   weight sync (rlhfkit/weightsync): all ranks gather
                                                   full params together (FSDP2), the sender the
                                                   transport gave this rank buckets and sends them
    EngineWorker(index, build)                     build(DistInfo[, tp]) -> RolloutEngine (async actor)
      .setup(device, num_engines, shard)           shard: (engine, rank, ShardGroupSpec) of a
                                                   tensor-parallel engine; shards 1.. then serve
                                                   shard 0's steps on a background thread
      .agenerate / .generate / .sleep / .wake_up   (first shards only)
      .pause / .resume(version) / .set_policy_version(version)
                                                   (first shards; engines without them: no-ops)
      .update_weights(refs) / .init_weight_sync(receiver) / .load_bucket(metas, payload)
                                                   (every shard: each keeps its slice)

A group of one rank creates no process group, exactly like one-process train_ppo (so a Ray run
with single-rank groups executes the same float operations as train_ppo). Role workers run two
threads so that the health monitor's `ping` is answered while a long call runs; the driver never
sends a role two calls at once.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator

import ray
import torch

from rlhfkit import logs
from rlhfkit.parallel.dist import DistInfo, init_distributed, resolve_device, use_expandable_segments, with_index
from rlhfkit.backend.offload import HostStash, MoveStats
from rlhfkit.parallel.rendezvous import reserve_port
from rlhfkit.backend.base import TrainBackend
from rlhfkit.roles.group import Role
from rlhfkit.roles.memory import CallMemory
from rlhfkit.rollout.base import ClosableEngine, RolloutEngine, SliceLoadingEngine, VersionedEngine
from rlhfkit.types import Completion, GenerationRequest
from rlhfkit.weightsync.buckets import Named, TensorMeta
from rlhfkit.weightsync.protocol import BucketReceiver, PushStats, WeightSender

if TYPE_CHECKING:
    from rlhfkit.rollout.builtin.model.tensor_parallel import ShardGroupSpec


def _node_info() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _quiet_env() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logs.setup()  # an actor's notes reach the driver's console (Ray forwards its output)


class RoleWorker:
    """One rank of policy / ref / critic / reward; see the module docstring."""

    def __init__(self, role: str, rank: int, world_size: int,
                 build: Callable[[str, DistInfo], tuple[Role, TrainBackend | None]]):
        _quiet_env()
        self.role_name, self.rank, self.world_size, self._build = role, rank, world_size, build
        self.role: Any = None  # a Role; reached by method name (`call`), like any of the roles
        self.backend: TrainBackend | None = None
        self.dist = DistInfo()
        self._sender: WeightSender | None = None
        self._stash: HostStash | None = None  # a reward model's weights under --deepspeed_enable_sleep
        self._memory: CallMemory | None = None

    def info(self) -> dict[str, Any]:
        return _node_info()

    def ping(self) -> int:
        return os.getpid()

    def reserve_port(self) -> int:
        """A master store opened here on a kernel-picked port, kept for the group this rank 0 forms
        next (race-free; rlhfkit/parallel/rendezvous.py); its port."""
        return reserve_port()

    def setup(self, master_addr: str, master_port: int, device: str | None) -> dict[str, Any]:
        """Join the group's process group (when world_size > 1) and build the role."""
        if self.world_size > 1:
            os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                              MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.dist = init_distributed(device)
        use_expandable_segments(self.dist.device)  # so that the memory plan holds
        role, self.backend = self._build(self.role_name, self.dist)
        self.role, self.dist = role, role.dist  # with the mesh the builder attached
        self._memory = CallMemory(self.role_name, self.rank, self.dist.device)
        return {"device": self.dist.device, "world_size": self.dist.world_size, "dp_rank": self.dist.dp_rank}

    def _enter(self) -> None:
        # calls may run on either of the actor's threads; the current CUDA device is per thread
        if self.dist.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.dist.device))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._enter()
        if self._memory is None:
            raise RuntimeError(f"{self.role_name} rank {self.rank}: {method} before setup")
        with self._memory.call(method):
            return getattr(self.role, method)(*args, **kwargs)

    def memory_peaks(self) -> dict[str, dict[str, int]]:
        """Peak reserved and allocated device bytes of each role method called since the last
        `memory_peaks()` (rlhfkit/roles/memory.py)."""
        return self._memory.take() if self._memory is not None else {}

    def init_weight_sync(self, sender: WeightSender) -> None:
        """Take this rank's part of the weight sync (broadcast: rank 0 forms the group with the engines)."""
        self._enter()
        sender.open(self.dist.device)
        self._sender = sender

    def push_weights(self, dtype: str | None, bucket_bytes: int) -> PushStats:
        """Every rank iterates the full weights (FSDP2 gathers: to the end); the sender sends its buckets."""
        self._enter()
        if self._sender is None:
            raise RuntimeError(f"{self.role_name} rank {self.rank}: push_weights before init_weight_sync")
        return self._sender.push(self.role.weights(), getattr(torch, dtype) if dtype else None, bucket_bytes)

    def backend_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._enter()
        return getattr(self.backend, method)(*args, **kwargs)

    def apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(role, backend, dist, *args)` inside the actor (e.g. saving the critic as an HF model)."""
        self._enter()
        return fn(self.role, self.backend, self.dist, *args)

    def offload(self) -> dict[str, float]:
        """Training states (or a reward model's weights) to host memory: --deepspeed_enable_sleep.
        Returns this rank's {"seconds", "bytes"} (backend/offload.py)."""
        self._enter()
        if self.backend is not None:
            return self.backend.offload_states().as_dict()
        if not self.dist.device.startswith("cuda"):
            return MoveStats().as_dict()
        if self._stash is None:
            self._stash = HostStash(self.dist.device)
        named = [(f"{i}:{n}", p) for i, m in enumerate(getattr(self.role, "models", []))
                 for n, p in m.named_parameters()]
        return self._stash.offload(named).as_dict()

    def reload(self) -> dict[str, float]:
        self._enter()
        if self.backend is not None:
            return self.backend.reload_states().as_dict()
        if self._stash is None:
            return MoveStats().as_dict()
        return self._stash.reload().as_dict()


class EngineWorker:
    """One rollout engine (builtin / hf / vllm), or one shard of a tensor-parallel builtin engine,
    as an async actor; requests run concurrently."""

    def __init__(self, index: int, build: Callable[..., RolloutEngine]):
        _quiet_env()
        self.index, self._build = index, build
        self.engine: RolloutEngine | None = None
        self.device = "cpu"
        self.shard_rank = 0
        self._receiver: BucketReceiver | None = None
        self._serving: Any = None

    async def info(self) -> dict[str, Any]:
        return _node_info()

    async def ping(self) -> int:
        if self._serving is not None and self._serving.done() and self._serving.exception() is not None:
            raise RuntimeError(f"engine shard {self.shard_rank} stopped: {self._serving.exception()!r}")
        return os.getpid()

    async def reserve_port(self) -> int:
        """As RoleWorker.reserve_port, for shard 0's tensor-parallel group."""
        return reserve_port()

    async def setup(self, device: str | None, num_engines: int, shard: tuple[int, int, ShardGroupSpec] | None = None
                    ) -> dict[str, Any]:
        """Build the engine. `shard` = (engine index, shard rank, ShardGroupSpec) for a tensor-parallel
        engine: the shards form their groups first; shards 1.. then run `serve()` in the background."""
        engine_index = self.index if shard is None else shard[0]
        # an indexed device: the shard group's set_device / NCCL need one ("cuda" alone is refused)
        dist = DistInfo(rank=engine_index, world_size=num_engines, device=with_index(resolve_device(device)))
        self.device = dist.device
        if shard is None:
            self.engine = await asyncio.to_thread(self._build, dist)
            return {"device": dist.device}
        from rlhfkit.rollout.builtin.model.tensor_parallel import join

        _, self.shard_rank, spec = shard

        def build() -> RolloutEngine:
            return self._build(dist, join(spec, self.shard_rank, dist.device))
        self.engine = await asyncio.to_thread(build)
        if self.shard_rank > 0:
            self._serving = asyncio.get_running_loop().run_in_executor(None, self._serve)
        return {"device": dist.device}

    @property
    def _engine(self) -> RolloutEngine:
        if self.engine is None:
            raise RuntimeError(f"engine {self.index}: called before setup()")
        return self.engine

    def _serve(self) -> int:
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        engine = self._engine
        if not isinstance(engine, SliceLoadingEngine):
            raise TypeError(f"engine shard {self.shard_rank}: {type(engine).__name__} cannot serve a tensor-parallel group")
        return engine.serve()

    async def agenerate(self, request: GenerationRequest) -> list[Completion]:
        return await self._engine.agenerate(request)

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        return await asyncio.to_thread(self._engine.generate, requests)

    def _load(self, pairs: Iterator[Named]) -> None:
        engine = self._engine
        if isinstance(engine, SliceLoadingEngine):  # a shard keeps its slice
            engine.update_weights_local(pairs)
        else:
            engine.update_weights(pairs)

    async def update_weights(self, refs: list[Any]) -> int:
        """Load the weight buckets `refs` (object store) into the engine; returns the tensor count."""
        buckets = await asyncio.gather(*refs)
        pairs = [p for b in buckets for p in b]
        await asyncio.to_thread(self._load, iter(pairs))
        return len(pairs)

    async def init_weight_sync(self, receiver: BucketReceiver) -> None:
        """Become a receiver of a direct weight sync (broadcast: join the group)."""
        await asyncio.to_thread(receiver.open, self.device)
        self._receiver = receiver

    async def load_bucket(self, metas: list[TensorMeta], payload: Any) -> int:
        """Receive one bucket (broadcast: its size; IPC: the handle) and load it; the tensor count."""
        if self._receiver is None:
            raise RuntimeError(f"engine {self.index}: load_bucket before init_weight_sync")
        receiver = self._receiver

        def load() -> int:
            pairs = receiver.receive(metas, payload)
            try:
                self._load(iter(pairs))
            finally:
                del pairs
                receiver.done()
            return len(metas)
        return await asyncio.to_thread(load)

    async def sleep(self, level: int = 1) -> None:
        await asyncio.to_thread(self._engine.sleep, level)

    async def pause(self) -> None:
        """Stop generating at the next step boundary (requests in flight keep their KV cache)."""
        engine = self._engine
        if isinstance(engine, VersionedEngine):
            await asyncio.to_thread(engine.pause)

    async def resume(self, version: int) -> None:
        """Continue generating; later tokens carry policy `version`."""
        engine = self._engine
        if isinstance(engine, VersionedEngine):
            await asyncio.to_thread(engine.resume, version)

    async def set_policy_version(self, version: int) -> None:
        engine = self._engine
        if isinstance(engine, VersionedEngine):
            await asyncio.to_thread(engine.set_policy_version, version)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self._engine.wake_up)

    async def memory(self) -> dict[str, int]:
        """This engine process's device memory: reserved now and at its peak since the last call (bytes)."""
        if not self.device.startswith("cuda"):
            return {}
        dev = torch.device(self.device)
        out = {"reserved": torch.cuda.memory_reserved(dev), "peak_reserved": torch.cuda.max_memory_reserved(dev)}
        torch.cuda.reset_peak_memory_stats(dev)
        return out

    async def close(self) -> None:
        if isinstance(self.engine, ClosableEngine) and self.shard_rank == 0:
            self.engine.close()
