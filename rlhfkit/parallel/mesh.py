"""`ParallelDims`: the one description of the training mesh, built from the flags, handed to the backend.

    flags (--zero_stage, --ds_tensor_parallel_size, --ring_attn_size) + world size
      |  ParallelDims.from_flags(...)        validated once; errors name the flag
      v
    ParallelDims(dp_replicate, dp_shard, cp, tp, world_size)
      |  .build_mesh(device_type)            one named DeviceMesh, outer to inner:
      v                                      ("dp_replicate", "dp_shard", "cp", "tp")
    FSDP2Backend: mesh[dims.fsdp_dim_names] -> fully_shard (with cp > 1 over dp_shard x cp flattened,
                  then apply_cp installs ring attention: context_parallel.py)

Data parallelism has two parts: `dp_shard` ranks shard parameters, gradients and optimizer
states (FSDP, `--zero_stage` 1-3); `dp_replicate` ranks hold replicas of that sharded group
(`--zero_stage 0` is `dp_replicate = world`, `dp_shard = 1`: plain replication; both > 1 is HSDP).
`tp` and `cp` are the tensor- and context-parallel sizes; the mesh always has all four named
dimensions (size 1 when unused), so later features take their sub-mesh by name.

`attach_mesh(dist, dims)` builds that mesh once per process and gives `DistInfo` its process
groups (`dist.MeshGroups`): dp (replicate x shard, the ranks that see different data), loss
(the dp group: the cp ranks gather their per-token outputs, so each computes the whole loss), tp,
cp, and the replica group (tp x cp: the ranks sharing one dp rank's rows). Ranks
lie in the mesh row-major, outer to inner, so dp_rank = rank // (cp x tp). With tp = cp = 1 the
dp and loss groups stay `None` (the default group): no new process group, no change in speed.

Modelled on torchtitan's `ParallelDims` (the idea, not its code).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as tdist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlhfkit.parallel.dist import DistInfo, MeshGroups

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
_FLAG_OF = {"tp": "--ds_tensor_parallel_size", "cp": "--ring_attn_size",
            "dp_shard": "dp_shard (from the world size and --zero_stage)",
            "dp_replicate": "dp_replicate (from the world size and --zero_stage)"}


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the training mesh; their product is the world size (checked on construction)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIM_NAMES:
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{_FLAG_OF[name]} must be an integer >= 1, got {size!r}")
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"parallel sizes dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"cp (--ring_attn_size) {self.cp} x tp (--ds_tensor_parallel_size) {self.tp} = {product}, "
                f"but the world size is {self.world_size}")

    @classmethod
    def from_flags(cls, world_size: int, zero_stage: int, tensor_parallel_size: int = 1,
                   ring_attn_size: int = 1) -> "ParallelDims":
        """The mesh for `world_size` ranks: what tp x cp leaves is data parallel, sharded for
        --zero_stage 1-3 and replicated for --zero_stage 0."""
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        for flag, size in (("--ds_tensor_parallel_size", tensor_parallel_size), ("--ring_attn_size", ring_attn_size)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {size!r}")
        inner = tensor_parallel_size * ring_attn_size
        if world_size % inner:
            raise ValueError(f"the world size ({world_size}) must be divisible by --ds_tensor_parallel_size "
                             f"({tensor_parallel_size}) x --ring_attn_size ({ring_attn_size}) = {inner}")
        dp = world_size // inner
        rep, shard = (dp, 1) if zero_stage == 0 else (1, dp)
        return cls(dp_replicate=rep, dp_shard=shard, cp=ring_attn_size, tp=tensor_parallel_size,
                   world_size=world_size)

    # ------------------------------------------------------------------ derived sizes

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas x shards): the ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_dim_names(self) -> tuple[str, ...]:
        """The mesh dimensions `fully_shard` gets: ("dp_replicate", "dp_shard") when replicated
        (FSDP2's hybrid mode), else ("dp_shard",)."""
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIM_NAMES)

    def check_supported(self) -> None:
        """Raise for the combinations no backend implements yet: tensor and context parallelism together
        (each works alone; the ring's gathered outputs are not vocabulary-parallel)."""
        if self.tp > 1 and self.cp > 1:
            raise ValueError(f"--ds_tensor_parallel_size {self.tp} with --ring_attn_size {self.cp}: tensor and "
                             "context parallelism together are not supported yet; use one of them")

    def check_backend(self, zero_stage: int, dist: DistInfo) -> None:
        """Raise unless this mesh fits the process group `dist` and --zero_stage (the backend's check)."""
        if self.world_size != dist.world_size:
            raise ValueError(f"ParallelDims was built for world size {self.world_size}, "
                             f"but this process group has {dist.world_size} ranks")
        self.check_supported()
        if self.tp > 1 and not dist.has_process_group:
            raise ValueError(f"--ds_tensor_parallel_size {self.tp} needs a process group (torchrun or Ray)")
        if zero_stage == 0 and self.dp_shard > 1:
            raise ValueError(f"--zero_stage 0 replicates the model, but the mesh shards it over dp_shard={self.dp_shard}")
        if zero_stage > 0 and self.dp_shard == 1 and self.dp_replicate > 1:
            raise ValueError(f"--zero_stage {zero_stage} shards over dp_shard, but the mesh has dp_shard=1 and "
                             f"dp_replicate={self.dp_replicate} (use --zero_stage 0 for plain replication)")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh over all ranks (needs the default process group)."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)

    def coordinate(self, rank: int) -> tuple[int, int, int, int]:
        """(dp_replicate, dp_shard, cp, tp) indices of global `rank` (row-major, tp innermost)."""
        rest, t = divmod(rank, self.tp)
        rest, c = divmod(rest, self.cp)
        rep, shard = divmod(rest, self.dp_shard)
        return rep, shard, c, t

    def dp_rank_of(self, rank: int) -> int:
        """The data-parallel rank of global `rank`: the share of the data it trains on."""
        rep, shard, _, _ = self.coordinate(rank)
        return rep * self.dp_shard + shard


def _subgroup(rank_lists: list[list[int]]) -> Any:
    """This rank's group of a partition of the world (every rank creates every group, in order)."""
    mine, _ = tdist.new_subgroups_by_enumeration(rank_lists)
    return mine


def _mesh_device_type(device: str) -> str:
    return device.split(":", 1)[0]


def attach_mesh(dist: DistInfo, dims: ParallelDims) -> DistInfo:
    """`dist` with the process groups of `dims` (module docstring); every rank must call it, once."""
    if dims.world_size != dist.world_size:
        raise ValueError(f"ParallelDims was built for world size {dims.world_size}, "
                         f"but this process group has {dist.world_size} ranks")
    if dist.world_size == 1 or not dist.has_process_group:
        return replace(dist, mesh=MeshGroups(dims=dims))
    mesh = dims.build_mesh(_mesh_device_type(dist.device))
    grid = mesh.mesh.reshape(dims.shape).tolist()  # global ranks [rep][shard][cp][tp]
    rep, shard, c, t = dims.coordinate(dist.rank)
    cells = [(r, s) for r in range(dims.dp_replicate) for s in range(dims.dp_shard)]
    groups: dict[str, Any] = {}
    if dims.tp * dims.cp > 1:  # otherwise dp = loss = the world: the default group
        groups["dp_group"] = _subgroup([[grid[r][s][ci][ti] for r, s in cells]
                                        for ci in range(dims.cp) for ti in range(dims.tp)])
        # context parallelism gathers per-token outputs over the ring (context_parallel.py): every cp
        # rank computes the whole loss, so the loss group is the dp group
        groups["loss_group"] = groups["dp_group"]
        groups["replica_group"] = _subgroup([[grid[r][s][ci][ti] for ci in range(dims.cp) for ti in range(dims.tp)]
                                             for r, s in cells])
    if dims.tp > 1:
        groups["tp_group"] = mesh.get_group("tp")
    if dims.cp > 1:
        groups["cp_group"] = mesh.get_group("cp")
    dp_rank = rep * dims.dp_shard + shard
    info = MeshGroups(dims=dims, device_mesh=mesh, dp_rank=dp_rank, dp_size=dims.dp,
                      loss_rank=dp_rank, loss_size=dims.dp, tp_rank=t, tp_size=dims.tp,
                      cp_rank=c, cp_size=dims.cp, replica_size=dims.tp * dims.cp, replica_src=grid[rep][shard][0][0],
                      **groups)
    return replace(dist, mesh=info)
