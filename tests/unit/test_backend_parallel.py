"""ParallelDims: sizes from the flags, validation naming the flag, what the FSDP2 backend accepts.
(The mesh itself is built under torchrun: tests/distributed/test_fsdp2_equivalence.py.)"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.parallel.mesh import MESH_DIM_NAMES, ParallelDims
from rlhfkit.config.configs import BackendConfig, OptimConfig


def test_from_flags_splits_the_world():
    d = ParallelDims.from_flags(8, zero_stage=3)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.dp) == (1, 8, 1, 1, 8)
    assert d.fsdp_dim_names == ("dp_shard",) and d.shape == (1, 8, 1, 1)
    d = ParallelDims.from_flags(8, zero_stage=0)
    assert (d.dp_replicate, d.dp_shard) == (8, 1) and d.fsdp_dim_names == ("dp_replicate", "dp_shard")
    d = ParallelDims.from_flags(16, zero_stage=2, tensor_parallel_size=2, ring_attn_size=4)
    assert d.shape == (1, 2, 4, 2) and d.dp == 2 and d.world_size == 16
    assert MESH_DIM_NAMES == ("dp_replicate", "dp_shard", "cp", "tp")
    hsdp = ParallelDims(dp_replicate=2, dp_shard=4, world_size=8)
    assert hsdp.fsdp_dim_names == ("dp_replicate", "dp_shard") and hsdp.dp == 8


def test_bad_sizes_name_the_flag():
    with pytest.raises(ValueError, match=r"world size \(6\) must be divisible by --ds_tensor_parallel_size \(4\)"):
        ParallelDims.from_flags(6, zero_stage=3, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="--ring_attn_size must be an integer >= 1"):
        ParallelDims.from_flags(2, zero_stage=3, ring_attn_size=0)
    with pytest.raises(ValueError, match="--zero_stage must be 0, 1, 2 or 3"):
        ParallelDims.from_flags(2, zero_stage=4)
    with pytest.raises(ValueError, match=r"= 4, but the world size is 3"):
        ParallelDims(dp_shard=2, tp=2, world_size=3)
    with pytest.raises(ValueError, match="--ds_tensor_parallel_size must be an integer >= 1"):
        ParallelDims(tp=0, world_size=1)


def backend(parallel: ParallelDims, world_size: int, zero_stage: int = 3) -> FSDP2Backend:
    # the checks run before any process group is needed
    dist = DistInfo(world_size=world_size, device="cpu")
    return FSDP2Backend(torch.nn.Linear(2, 2), BackendConfig(zero_stage=zero_stage, param_dtype="fp32"),
                        OptimConfig(), 1, dist, parallel=parallel)


def test_backend_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="--ds_tensor_parallel_size 2 needs a process group"):
        backend(ParallelDims.from_flags(2, 3, tensor_parallel_size=2), 2)
    with pytest.raises(ValueError, match="--ring_attn_size: model type None is not supported by ring attention"):
        backend(ParallelDims.from_flags(4, 3, ring_attn_size=2), 4)
    with pytest.raises(ValueError, match="built for world size 4, but this process group has 2 ranks"):
        backend(ParallelDims.from_flags(4, 3), 2)
    with pytest.raises(ValueError, match="--zero_stage 0 replicates the model"):
        backend(ParallelDims.from_flags(2, 3), 2, zero_stage=0)
    with pytest.raises(ValueError, match="--zero_stage 3 shards over dp_shard"):
        backend(ParallelDims.from_flags(2, 0), 2, zero_stage=3)


def test_default_dims_follow_zero_stage():
    b = FSDP2Backend(torch.nn.Linear(2, 2), BackendConfig(zero_stage=0, param_dtype="fp32"), None, 1,
                     DistInfo(device="cpu"))
    assert b.parallel == ParallelDims(world_size=1) and b.mesh is None  # one process: no mesh at all
