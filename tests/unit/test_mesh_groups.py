"""The data-parallel view of `DistInfo` with a mesh (no process group needed: `MeshGroups` is a
plain record), and the samplers and prompt sharding that read it: rank 3 of a dp 2 x tp 2 mesh
must get exactly what rank 1 of 2 pure data-parallel ranks gets."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.algo.advantages import AdvantageConfig
from rlhfkit.algo.experience import RewardShapingConfig
from rlhfkit.algo.kl import FixedKLController
from rlhfkit.parallel.dist import DistInfo, MeshGroups
from rlhfkit.parallel.mesh import ParallelDims, attach_mesh
from rlhfkit.trainers.offline import rank_share
from rlhfkit.trainers.rl import RLLoopConfig, RLTrainer
from rlhfkit.types import PromptSample

DIMS = ParallelDims(dp_shard=2, tp=2, world_size=4)


def mesh_rank(rank: int) -> DistInfo:
    return DistInfo(rank=rank, world_size=4, mesh=MeshGroups(dims=DIMS, dp_rank=DIMS.dp_rank_of(rank), dp_size=2,
                                                             loss_size=2, tp_rank=rank % 2, tp_size=2))


def test_dp_rank_of_is_row_major_with_tp_innermost():
    assert [DIMS.dp_rank_of(r) for r in range(4)] == [0, 0, 1, 1]
    d = ParallelDims(dp_replicate=2, dp_shard=1, cp=2, tp=2, world_size=8)
    assert [d.dp_rank_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert d.coordinate(6) == (1, 0, 1, 0)
    assert ParallelDims(dp_shard=4, world_size=4).dp_rank_of(3) == 3


def test_distinfo_without_mesh_is_pure_data_parallel():
    d = DistInfo(rank=1, world_size=2)
    assert (d.dp_rank, d.dp_size, d.loss_size, d.dp_group) == (1, 2, 2, None)
    m = mesh_rank(3)
    assert (m.dp_rank, m.dp_size, m.loss_size) == (1, 2, 2)
    assert m == DistInfo(rank=3, world_size=4)  # the mesh is not part of the identity


def test_one_process_mesh_and_reductions_are_no_ops():
    d = attach_mesh(DistInfo(), ParallelDims())
    assert d.mesh is not None and (d.dp_rank, d.dp_size) == (0, 1)
    assert d.all_reduce_dp(2.5) == 2.5 and d.all_reduce_world(3, op="max") == 3
    assert torch.equal(d.all_reduce_loss(torch.ones(2)), torch.ones(2))
    assert d.broadcast_replica({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="built for world size 4"):
        attach_mesh(DistInfo(), DIMS)


def test_offline_share_follows_the_dp_rank():
    batch = list(range(8))
    pure = [rank_share(batch, DistInfo(rank=r, world_size=2)) for r in range(2)]
    assert pure == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_share(batch, mesh_rank(r)) for r in range(4)] == [pure[0], pure[0], pure[1], pure[1]]


def _trainer(dist: DistInfo) -> RLTrainer:
    cfg = RLLoopConfig(rollout_batch_size=4, n_samples_per_prompt=1, show_progress=False)
    return RLTrainer(cfg, AdvantageConfig(advantage_estimator="reinforce"), RewardShapingConfig(), policy=None,
                     executor=None, prompts=[PromptSample(prompt=f"p{i}", index=i) for i in range(8)],
                     dist=dist, logger=None, pad_token_id=0, kl_ctl=FixedKLController(0.0), weight_sync=object())


def test_rl_prompts_follow_the_dp_rank():
    def drawn(dist):
        prompts, first = _trainer(dist)._next_prompts()
        return [p.index for p in prompts], first

    pure = [drawn(DistInfo(rank=r, world_size=2)) for r in range(2)]
    assert len(pure[0][0]) == 2 and set(pure[0][0]).isdisjoint(pure[1][0])
    assert [drawn(mesh_rank(r)) for r in range(4)] == [pure[0], pure[0], pure[1], pure[1]]
    with pytest.raises(ValueError, match=r"multiple of the data-parallel size \(3\)"):
        _trainer(DistInfo(rank=0, world_size=6, mesh=MeshGroups(dims=None, dp_size=3)))


def test_ray_group_splits_by_dp_rank(monkeypatch):
    """Actors 0, 1 (dp rank 0) and 2, 3 (dp rank 1) of a dp 2 x tp 2 group: each pair gets the same
    half of the batch, and the merged result holds each half once."""
    pytest.importorskip("ray")
    from rlhfkit.distributed import group as G
    from rlhfkit.roles.actor import ActorRole
    from rlhfkit.types import ExperienceBatch

    class Remote:
        def __init__(self, fn):
            self.remote = fn

    class FakeActor:
        def __init__(self):
            self.seen = None
            self.call = Remote(self._call)

        def _call(self, method, batch):
            assert method == "forward_logprobs"
            self.seen = batch.input_ids[:, 0].tolist()
            return batch.input_ids[:, :1].float() * 10

    monkeypatch.setattr(G, "wait_all", lambda refs, labels, monitor=None: list(refs))
    actors = [FakeActor() for _ in range(4)]
    g = G.RayGroup("policy", actors, [None] * 4, dp_ranks=[0, 0, 1, 1], unit=2)
    ids = torch.arange(8)[:, None].repeat(1, 3)
    out = g.on_batch(ActorRole.forward_logprobs, ExperienceBatch(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                     loss_mask=torch.ones_like(ids)))
    assert [a.seen for a in actors] == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert out[:, 0].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
    with pytest.raises(ValueError, match=r"dp ranks \[0, 2\]"):
        G.RayGroup("policy", actors[:2], [None] * 2, dp_ranks=[0, 2])
