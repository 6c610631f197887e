"""Direct weight sync on GPUs (rlhfkit/weightsync): CUDA IPC and NCCL broadcast.

- CUDA IPC (1 GPU): a spawned process opens the handle of a packed GPU bucket (mixed dtypes, a
  tied pair) and gets the same bytes; the sender frees the bucket only after the answer.
- NCCL (2 GPUs): rank 0 on GPU 0 broadcasts buckets to rank 1 on GPU 1 through a group built
  from its own TCPStore, without any default process group.
- Ray (2 GPUs, ray importable): a policy-like RoleWorker and engine-like EngineWorkers; the
  disaggregated placement picks NCCL broadcast, the colocated one (policy and engine on one GPU,
  half of it each) picks CUDA IPC; both deliver the policy's tensors bit for bit, cast to bf16.
"""

from __future__ import annotations


import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port
from rlhfkit.weightsync.buckets import pack_bucket, unpack_bucket
from rlhfkit.weightsync.collective import GroupSpec, broadcast, check_group, make_group
from rlhfkit.weightsync.ipc import ipc_handle, open_ipc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def tensors(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    emb = torch.randn(64, 32, generator=g)
    named = [("embed", emb), ("norm", torch.randn(32, generator=g).bfloat16()),
             ("ids", torch.arange(9, dtype=torch.int64)), ("half", torch.randn(5, 7, generator=g).half()),
             ("head", emb)]
    if device == "cpu":
        return named
    moved: dict[int, torch.Tensor] = {}
    return [(n, moved.setdefault(id(t), t.to(device))) for n, t in named]  # the tie survives the move


def as_bytes(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple, bytes]]:
    """Plain picklable copies (tensors through a queue would need the sending process alive)."""
    return [(n, str(t.dtype), tuple(t.shape), t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            for n, t in named]



def _ipc_child(q_in, q_out) -> None:
    handle, metas = q_in.get()
    flat = open_ipc(handle, "cuda:0")
    out = as_bytes(unpack_bucket(flat, metas))
    torch.cuda.synchronize()
    del flat
    q_out.put(out)


def test_cuda_ipc_bucket_round_trip():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(q_in, q_out))
    p.start()
    flat, metas = pack_bucket(tensors("cuda:0"), "cuda:0")
    q_in.put((ipc_handle(flat), metas))
    got = q_out.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert got == as_bytes(tensors())  # names, dtypes, shapes and bytes
    del flat
    torch.cuda.ipc_collect()


def _nccl_member(rank: int, port: int, q) -> None:
    torch.cuda.set_device(rank)
    _, pg = make_group(GroupSpec("127.0.0.1", port, 2, "nccl", timeout_s=60), rank)
    check_group(pg, rank, f"cuda:{rank}")
    flat, metas = pack_bucket(tensors(f"cuda:{rank}"), f"cuda:{rank}", cast=torch.bfloat16)
    if rank == 1:
        flat = torch.empty_like(flat)
    broadcast(pg, flat)
    torch.cuda.synchronize()
    if rank == 1:
        q.put(as_bytes(unpack_bucket(flat, metas)))


@two_gpus
def test_nccl_group_broadcasts_bucket():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_member, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = q.get(timeout=180)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got == as_bytes([(n, t.bfloat16() if t.is_floating_point() else t) for n, t in tensors()])


@two_gpus
@pytest.mark.parametrize("layout, method", [("disaggregated", "broadcast over nccl"), ("colocated", "ipc")])
def test_ray_actors_sync_on_gpus(layout, method):
    import sys

    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    from rlhfkit.distributed.workers import EngineWorker, RoleWorker
    from rlhfkit.weightsync.choice import Endpoint, choose_transport
    from rlhfkit.weightsync.protocol import SyncPeers

    class FakeRole:
        def __init__(self, dist):
            self.dist = dist  # a role's rank and device (roles.group.Role)

        def weights(self):
            return iter(tensors("cuda"))

    class Recorder:
        def __init__(self):
            self.got = {}

        def update_weights(self, named):
            self.got.update({n: t.to("cuda", copy=True) for n, t in named})

        def generate(self, requests):
            return {n: t.cpu() for n, t in self.got.items()}

    def build_role(role, dist):
        return FakeRole(dist), None

    def build_engine(dist):
        return Recorder()

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test file
    started = not ray.is_initialized()
    if started:
        ray.init(num_gpus=2, include_dashboard=False)
    try:
        opts: dict = {"num_cpus": 0, "num_gpus": 1.0}
        pg = None
        if layout == "colocated":  # one GPU, half each (as the launcher's shared slots)
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            pg = placement_group([{"GPU": 1}])
            assert pg.wait(timeout_seconds=60)
            opts = {"num_cpus": 0, "num_gpus": 0.5,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}
        policy = ray.remote(RoleWorker).options(max_concurrency=2, **opts).remote("policy", 0, 1, build_role)
        engine = ray.remote(EngineWorker).options(**opts).remote(0, build_engine)
        ray.get([policy.setup.remote("127.0.0.1", 0, "cuda"), engine.setup.remote("cuda", 1)])
        infos = ray.get([policy.info.remote(), engine.info.remote()])
        ends = [Endpoint(i["node_id"], tuple(i["gpu_ids"]), "cuda") for i in infos]
        transport = choose_transport("auto", ends[:1], ends[1:])
        assert transport.describe().startswith(method), (transport, infos)
        transport.connect(SyncPeers([policy], [infos[0]["ip"]], [engine], [infos[1]["ip"]],
                                    lambda refs, who: ray.get(refs, timeout=120), timeout_s=60))
        stats = ray.get(policy.push_weights.remote("bfloat16", 4096), timeout=120)
        assert stats.buckets >= 2 and stats.engine_tensors == {0: 5}
        got = ray.get(engine.generate.remote([]), timeout=60)
        for n, t in tensors():
            want = t.bfloat16() if t.is_floating_point() else t
            assert torch.equal(got[n], want), n
        for a in (policy, engine):
            ray.kill(a, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
    finally:
        if started:
            ray.shutdown()
