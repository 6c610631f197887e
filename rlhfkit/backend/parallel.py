"""`ParallelDims`: the one description of the training mesh, built from the flags, handed to the backend.

    flags (--zero_stage, --ds_tensor_parallel_size, --ring_attn_size) + world size
      |  ParallelDims.from_flags(...)        validated once; errors name the flag
      v
    ParallelDims(dp_replicate, dp_shard, cp, tp, world_size)
      |  .build_mesh(device_type)            one named DeviceMesh, outer to inner:
      v                                      ("dp_replicate", "dp_shard", "cp", "tp")
    FSDP2Backend: mesh[dims.fsdp_dim_names] -> fully_shard (apply_tp / apply_cp slot in before it)

Data parallelism has two parts: `dp_shard` ranks shard parameters, gradients and optimizer
states (FSDP, `--zero_stage` 1-3); `dp_replicate` ranks hold replicas of that sharded group
(`--zero_stage 0` is `dp_replicate = world`, `dp_shard = 1`: plain replication; both > 1 is HSDP).
`tp` and `cp` are the tensor- and context-parallel sizes; the mesh always has all four named
dimensions (size 1 when unused), so later features take their sub-mesh by name.

Modelled on torchtitan's `ParallelDims` (the idea, not its code).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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
        """Raise for the dimensions no backend implements yet (tensor and context parallelism)."""
        if self.tp > 1:
            raise ValueError(f"--ds_tensor_parallel_size {self.tp}: tensor-parallel training is not supported yet")
        if self.cp > 1:
            raise ValueError(f"--ring_attn_size {self.cp}: context parallelism (ring attention) is not supported yet")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh over all ranks (needs the default process group)."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
