"""Tensor parallelism of the builtin engine: the shard group and its control channel, weight loading per shard.

One engine spans N processes (one GPU each, or CPU processes over gloo in tests):

    TensorParallelGroup(rank, size, group, control)
        group    the process group of the model's collectives (NCCL on GPUs, gloo on CPU): the
                 all-reduce after o / down and the all-gather of the vocab-parallel logits (model/decoder.py)
        control  a gloo group for shard 0's step operations (`ControlChannel`)

    make_group(...)      from an existing default process group (torchrun), or
    join(spec, rank)     from a TCP rendezvous of the engine's own (Ray engine actors), or
    from_torchrun(size)  a command started by `torchrun --nproc_per_node size` (batch_inference --tp_size)

Where the process groups come from is the caller's business; the engine only needs this record.
Shard 0 mirrors its step operations to the others over the control channel (loop/mirror.py).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlhfkit.config.dtypes import TORCH_DTYPES
from rlhfkit.models.hf_config import ConfigFields
from rlhfkit.rollout.builtin.model.shared_weights import adopt_parameters
from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.rollout.builtin.model.weights import ModelWeights, load_from_hf_model, load_from_safetensors

if TYPE_CHECKING:
    from transformers import GenerationConfig


class ControlChannel:
    """Operations from shard 0 to the other shards of one engine: `broadcast_object_list` over a CPU
    (gloo) process group whose first member is shard 0."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.src = dist.get_global_rank(group, 0)

    def send(self, message: Any) -> None:
        self._dist.broadcast_object_list([message], src=self.src, group=self.group)

    def receive(self) -> Any:
        box = [None]
        self._dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


@dataclass
class TensorParallelGroup:
    """This process's place in a tensor-parallel engine (see the module docstring)."""

    rank: int
    size: int
    group: Any = None
    control: Any = None
    channel: ControlChannel | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.size > 1 and self.channel is None:
            if self.group is None or self.control is None:
                raise ValueError("a TensorParallelGroup of size > 1 needs its process group and a gloo control group")
            self.channel = ControlChannel(self.control)

    @property
    def control_channel(self) -> ControlChannel:
        """The channel of the shards' step operations (a group of size > 1 has one)."""
        if self.channel is None:
            raise RuntimeError("a one-shard TensorParallelGroup has no control channel")
        return self.channel

    @property
    def group_name(self) -> str | None:
        return None if self.group is None else self.group.group_name


def make_group(ranks: list[int] | None = None) -> TensorParallelGroup:
    """The shard group over `ranks` of the default process group (all ranks when None): the
    model's group on the default backend, the control group on gloo."""
    import torch.distributed as dist

    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    group = dist.new_group(ranks)
    control = dist.new_group(ranks, backend="gloo")
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not among the engine's ranks {ranks}")
    return TensorParallelGroup(ranks.index(me), len(ranks), group, control)


def from_torchrun(size: int, device: str, flag: str = "--tp_size") -> tuple[TensorParallelGroup, str]:
    """(shard group, this rank's device) for a command run by `torchrun --nproc_per_node size`: one
    engine over all the ranks, NCCL on CUDA, gloo on CPU."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != size:
        raise ValueError(f"{flag} {size}: start the command with `torchrun --nproc_per_node {size}` "
                         f"(WORLD_SIZE is {world})")
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None)
    return make_group(), device


@dataclass(frozen=True)
class ShardGroupSpec:
    """A TCP rendezvous for one engine's shards (sent to every shard actor)."""

    host: str
    port: int
    size: int
    backend: str  # nccl | gloo
    timeout_s: float = 600.0


def join(spec: ShardGroupSpec, rank: int, device: str) -> TensorParallelGroup:
    """Form this shard's groups: the default process group of this (engine-only) process, on
    `spec.backend`, plus a gloo control group. Each shard actor is its own process, so the
    default group belongs to the engine."""
    import torch.distributed as dist

    if device.startswith("cuda"):  # indexed ("cuda:N"): EngineWorker.setup resolves it (dist.with_index)
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        from rlhfkit.parallel.rendezvous import destroy_at_exit, held_store

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        # shard 0 serves the store it opened on a kernel-picked port (reserve_port); the others connect
        store = held_store(spec.port, spec.timeout_s) if rank == 0 else None
        where: dict[str, Any] = ({"store": dist.PrefixStore("default_pg", store)} if store is not None
                                 else {"init_method": f"tcp://{spec.host}:{spec.port}"})
        dist.init_process_group(spec.backend, rank=rank, world_size=spec.size, timeout=timeout,
                                device_id=torch.device(device) if spec.backend == "nccl" else None, **where)
        destroy_at_exit()
    group = dist.group.WORLD
    control = dist.new_group(list(range(spec.size)), backend="gloo")
    tp = TensorParallelGroup(rank, spec.size, group, control)
    _check(tp, device)
    return tp


def _check(tp: TensorParallelGroup, device: str) -> None:
    """One all-reduce on the model's group (forms NCCL's communicator before any CUDA graph capture)."""
    import torch.distributed as dist

    t = torch.ones(1, device=device)
    dist.all_reduce(t, group=tp.group)
    if int(t.item()) != tp.size:
        raise RuntimeError(f"tensor-parallel group check: shard {tp.rank} summed {t.item()}, expected {tp.size}")


def load_weights(model: Any, dtype: torch.dtype | None, device: torch.device, tp: TensorParallelGroup | None,
                 share: bool = False
                 ) -> tuple[Any, GenerationConfig | None, torch.dtype, ModelSpec, ModelWeights, frozenset[str]]:
    """(HF config, generation config (None: none), dtype, spec, weights, names shared with the module)
    of this shard, from an HF module, a model directory (safetensors read slice by slice) or an HF config
    alone (random weights, as HF initialises them: normal(0, initializer_range), norms 1; for benchmarks).
    `share` (an HF module, no tensor parallelism): the module's parameters become views of the engine's
    weights where they fit (shared_weights.adopt_parameters), so that both hold one copy."""
    shard = (tp.rank, tp.size, tp.group_name) if tp is not None and tp.size > 1 else None
    from transformers import PretrainedConfig

    if isinstance(model, PretrainedConfig):
        dtype = dtype or _config_dtype(model)
        spec, weights = random_weights(model, dtype, device, shard)
        return model, None, dtype, spec, weights, frozenset()
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig, GenerationConfig

        path = str(model)
        config = AutoConfig.from_pretrained(path)
        dtype = dtype or _config_dtype(config)
        try:
            gen = GenerationConfig.from_pretrained(path)
        except (OSError, ValueError):
            gen = None
        spec, weights = load_from_safetensors(path, config, dtype, device, shard)
        return config, gen, dtype, spec, weights, frozenset()
    dtype = dtype or next(model.parameters()).dtype
    if share:
        if shard is not None:
            raise ValueError("a tensor-parallel engine cannot share the module's weights (each shard holds a slice)")
        spec, weights, shared = adopt_parameters(model, dtype, device)
        return model.config, model.generation_config, dtype, spec, weights, shared
    spec, weights = load_from_hf_model(model, dtype, device, shard)
    return model.config, model.generation_config, dtype, spec, weights, frozenset()


def random_weights(config: Any, dtype: torch.dtype, device: torch.device,
                   shard: tuple[int, int, str | None] | None, seed: int = 0) -> tuple[ModelSpec, ModelWeights]:
    """A shard's weights drawn on `device` (each shard draws its own slices: the shards of one
    engine do not form one consistent model, which a throughput benchmark does not need)."""
    from rlhfkit.rollout.builtin.model.spec import shard_spec
    from rlhfkit.rollout.builtin.model.weights import allocate_weights

    spec = shard_spec(config, shard)
    qkv_bias = getattr(config, "model_type", "") in ("qwen2", "qwen2_vl", "qwen2_5_vl")
    names = {"model.layers.0.self_attn.q_proj.bias"} if qkv_bias else set()
    if getattr(config, "attention_bias", False):
        names |= {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.bias"}
    weights = allocate_weights(spec, names, dtype, device)
    g = torch.Generator(device=device).manual_seed(seed + 7919 * (shard[0] if shard else 0))
    std = float(getattr(config, "initializer_range", 0.02))
    for name, t in weights.tensors().items():
        if name.endswith("norm"):
            t.fill_(1.0)
        elif t.dim() == 1:
            t.zero_()
        else:
            t.normal_(0.0, std, generator=g)
    return spec, weights


def _config_dtype(config: Any) -> torch.dtype:
    dt = ConfigFields.of(config).dtype  # (transformers 5 reads a config.json's torch_dtype into dtype)
    if isinstance(dt, str):
        dt = TORCH_DTYPES.get(dt)
    return dt if isinstance(dt, torch.dtype) else torch.float32
