"""Start the Ray side of an RL run: connect, place, create and set up the actors.

    started = connect(address)                      # join a running cluster, else start a local one
    roles = launch(RoleSpec..., EngineSpec, LaunchConfig, monitor, phases)
        plan_pools -> check_fits (fails at once) -> create_pool per pool (timed wait)
        -> actors, slot by slot (colocated actors of a slot share it: 1/k of its resources)
        -> info (pid, node) -> rank 0's address + a free port -> setup on every actor at once
           (each role group forms its own torch process group; the shards of a tensor-parallel
           engine form theirs; engines load their weights, each shard its slices)
        -> weight sync transport (weightsync.choose_transport over every engine shard, then its
           `connect`; broadcast: policy rank 0 and the shards form their own group) -> `RayWeightSync`
    roles.groups["policy"].call(...), roles.router.agenerate(...)
    roles.shutdown()

`launch` reads no flags: the CLI passes the shapes, the builders (picklable callables that turn
a DistInfo into a role or an engine) and the options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhfkit.config.configs import BackendFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.rl_flags import PlacementFlags
from rlhfkit.distributed.engines import RayEngineRouter
from rlhfkit.distributed.group import Phases, RayGroup
from rlhfkit.distributed.health import ActorLabel, HealthMonitor, wait_all
from rlhfkit.distributed.placement import (ReadyPool, Shape, SlotResources, check_fits, create_pool,
                                           plan_pools, remove_pools)
from rlhfkit.distributed.workers import EngineWorker, RoleWorker
from rlhfkit.weightsync.buckets import DEFAULT_BUCKET_MB
from rlhfkit.weightsync.choice import Endpoint, choose_transport
from rlhfkit.weightsync.collective import DEFAULT_TIMEOUT_S
from rlhfkit.weightsync.protocol import SyncPeers, WeightTransport
from rlhfkit.weightsync.sync import RayWeightSync
from rlhfkit.backend.base import TrainBackend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.roles.group import Role
from rlhfkit.rollout.base import RolloutEngine

if TYPE_CHECKING:
    from rlhfkit.rollout.builtin.model.tensor_parallel import ShardGroupSpec


def connect(address: str | None = None) -> bool:
    """Join the cluster at `address`, else $RAY_ADDRESS, else the last `ray start` on this machine,
    else start a local Ray (Ray's own order for `ray.init()`; never "auto", which would join any
    Ray instance found running on the machine). Returns True when this call initialised Ray (the
    caller calls `ray.shutdown()`: a disconnect, or the end of the local instance)."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    except ConnectionError as e:
        raise ConnectionError(f"{e}\n(--ray_address local starts a new local Ray instead)") from None
    return True


@dataclass
class RoleSpec:
    name: str  # policy, ref, critic, reward
    shape: Shape
    build: Callable[[str, DistInfo], tuple[Role, TrainBackend | None]]  # (role name, DistInfo) -> (role, backend)


@dataclass
class EngineSpec:
    num_engines: int
    tensor_parallel_size: int
    build: Callable[..., RolloutEngine]  # (DistInfo[, its TensorParallelGroup]) -> the engine


@dataclass
class LaunchConfig:
    resources: SlotResources = field(default_factory=SlotResources)
    device: str | None = default_of(BackendFlags, "device")
    colocate_all: bool = False
    colocate_actor_ref: bool = default_of(PlacementFlags, "colocate_actor_ref")
    colocate_critic_reward: bool = default_of(PlacementFlags, "colocate_critic_reward")
    placement_timeout_s: float = 60.0
    unit: int = 1  # rows that stay on one rank (samples of one prompt)
    weights_dtype: str | None = None  # dtype of the weights sent to engines (None: as trained)
    weight_sync: str = default_of(PlacementFlags, "weight_sync")  # weightsync.choice.choose_transport
    weight_sync_bucket_bytes: int = DEFAULT_BUCKET_MB * 2**20
    weight_sync_backend: str = "nccl"  # broadcast on GPUs: nccl, or gloo to force CPU buffers
    weight_sync_timeout_s: float = DEFAULT_TIMEOUT_S
    engine_direct: bool = True  # False: engines with their own loading path (vLLM) use the object store


@dataclass
class LaunchedRoles:
    groups: dict[str, RayGroup]
    router: RayEngineRouter
    pools: list[ReadyPool]
    monitor: HealthMonitor
    placement: list[dict[str, Any]]  # one line per actor: role, rank, pid, node, pool, bundle
    weight_sync: WeightTransport | None = None
    sync: RayWeightSync | None = None  # the loop's weight-sync object

    def shutdown(self) -> None:
        self.monitor.stop()
        for g in self.groups.values():
            for a in g.actors:
                ray.kill(a, no_restart=True)
        for a in self.router.shards:
            ray.kill(a, no_restart=True)
        remove_pools(self.pools)


def _create_actors(pool: ReadyPool, roles: dict[str, RoleSpec], engines: EngineSpec,
                   cfg: LaunchConfig) -> dict[str, list[Any]]:
    """One actor per member per slot, slot by slot, each with 1/k of its slot."""
    members = pool.spec.members
    opts = cfg.resources.actor_options(len(members))
    out: dict[str, list[Any]] = {m: [] for m in members}
    for rank, bundle in enumerate(pool.bundle_of_rank):
        strategy = PlacementGroupSchedulingStrategy(pool.pg, placement_group_bundle_index=bundle)
        for m in members:
            if m == "engine":
                engine_cls = ray.remote(EngineWorker).options(scheduling_strategy=strategy, **opts)
                out[m].append(engine_cls.remote(rank, engines.build))
            else:
                world = pool.spec.shape.slots
                role_cls = ray.remote(RoleWorker).options(scheduling_strategy=strategy, max_concurrency=2, **opts)
                out[m].append(role_cls.remote(m, rank, world, roles[m].build))
    return out


def launch(roles: list[RoleSpec], engines: EngineSpec, cfg: LaunchConfig, monitor: HealthMonitor,
           phases: Phases | None = None) -> LaunchedRoles:
    by_name = {r.name: r for r in roles}
    pools_spec = plan_pools({r.name: r.shape for r in roles}, engines.num_engines, engines.tensor_parallel_size,
                            colocate_all=cfg.colocate_all, colocate_actor_ref=cfg.colocate_actor_ref,
                            colocate_critic_reward=cfg.colocate_critic_reward)
    check_fits(pools_spec, cfg.resources, wait_s=min(10.0, cfg.placement_timeout_s))
    pools: list[ReadyPool] = []
    try:
        for spec in pools_spec:
            pools.append(create_pool(spec, cfg.resources, cfg.placement_timeout_s))
        actors: dict[str, list[Any]] = {}
        where: dict[str, list[tuple[str, int]]] = {}
        for pool in pools:
            for m, lst in _create_actors(pool, by_name, engines, cfg).items():
                actors[m] = lst
                where[m] = [(pool.spec.name, b) for b in pool.bundle_of_rank]
        return _setup(actors, where, pools, cfg, monitor, phases, engines)
    except BaseException:
        remove_pools(pools)
        raise


def _shard_specs(engine_actors: list[Any], labels: list[ActorLabel], tp: int, cfg: LaunchConfig,
                 monitor: HealthMonitor) -> list[tuple[int, int, ShardGroupSpec] | None]:
    """Per engine shard: None (tp 1), or (engine, shard rank, the engine's ShardGroupSpec)."""
    if tp == 1:
        return [None] * len(engine_actors)
    from rlhfkit.rollout.builtin.model.tensor_parallel import ShardGroupSpec

    gpu = cfg.resources.accelerator == "GPU" and (cfg.device is None or cfg.device.startswith("cuda"))
    firsts = list(range(0, len(engine_actors), tp))
    ports = wait_all([engine_actors[i].reserve_port.remote() for i in firsts], [labels[i] for i in firsts], monitor)
    out: list[tuple[int, int, ShardGroupSpec] | None] = []
    for e, (first, port) in enumerate(zip(firsts, ports)):
        spec = ShardGroupSpec(labels[first].node or "127.0.0.1", port, tp, "nccl" if gpu else "gloo")
        out.extend((e, k, spec) for k in range(tp))
    return out


def _setup(actors: dict[str, list[Any]], where: dict[str, list[tuple[str, int]]], pools: list[ReadyPool],
           cfg: LaunchConfig, monitor: HealthMonitor, phases: Phases | None, engines: EngineSpec) -> LaunchedRoles:
    num_engines, tp = engines.num_engines, engines.tensor_parallel_size
    names = list(actors)
    flat = [(m, r, a) for m in names for r, a in enumerate(actors[m])]
    infos = wait_all([a.info.remote() for _, _, a in flat], [ActorLabel(m, r) for m, r, _ in flat], monitor,
                     timeout=cfg.placement_timeout_s + 120)
    labels: dict[str, list[ActorLabel]] = {m: [] for m in names}
    placement = []
    for (m, r, a), info in zip(flat, infos):
        label = ActorLabel("engine" if m == "engine" else m, r, info["pid"], info["ip"])
        labels[m].append(label)
        monitor.register(a, label)
        pool, bundle = where[m][r]
        placement.append({"role": m, "rank": r, "pid": info["pid"], "node_id": info["node_id"], "ip": info["ip"],
                          "pool": pool, "bundle": bundle, "gpu_ids": info["gpu_ids"]})
    refs, ref_labels = [], []
    for m in names:
        if m == "engine":
            shards = _shard_specs(actors[m], labels[m], tp, cfg, monitor)
            for r, a in enumerate(actors[m]):
                refs.append(a.setup.remote(cfg.device, num_engines, shards[r]))
                ref_labels.append(labels[m][r])
            continue
        port = wait_all([actors[m][0].reserve_port.remote()], labels[m][:1], monitor)[0] if len(actors[m]) > 1 else 0
        addr = labels[m][0].node or "127.0.0.1"
        for r, a in enumerate(actors[m]):
            refs.append(a.setup.remote(addr, port, cfg.device))
            ref_labels.append(labels[m][r])
    done = wait_all(refs, ref_labels, monitor)
    devices = {(lab.role, lab.rank): d["device"] for lab, d in zip(ref_labels, done)}
    transport = _weight_sync(actors, labels, placement, devices, cfg, monitor)
    monitor.start()
    dp_of = {(lab.role, lab.rank): d.get("dp_rank", lab.rank) for lab, d in zip(ref_labels, done)}
    groups = {m: RayGroup(m, actors[m], labels[m], monitor, unit=cfg.unit, phases=phases,
                          weights_dtype=cfg.weights_dtype, dp_ranks=[dp_of[(m, r)] for r in range(len(actors[m]))])
              for m in names if m != "engine"}
    first = list(range(0, len(actors["engine"]), tp))  # an engine's shard 0 serves it
    router = RayEngineRouter([actors["engine"][i] for i in first], [labels["engine"][i] for i in first], monitor,
                             phases, bucket_bytes=cfg.weight_sync_bucket_bytes, shards=actors["engine"],
                             shard_labels=labels["engine"])
    router.wake_for_update = not cfg.engine_direct
    sync = RayWeightSync(groups["policy"], router, transport, cfg.weights_dtype, cfg.weight_sync_bucket_bytes)
    return LaunchedRoles(groups, router, pools, monitor, placement, transport, sync)


def _weight_sync(actors: dict[str, list[Any]], labels: dict[str, list[ActorLabel]], placement: list[dict[str, Any]],
                 devices: dict[tuple[str, int], str], cfg: LaunchConfig, monitor: HealthMonitor) -> WeightTransport:
    """Choose the policy -> engines weight transport from where the actors ended up, and connect it."""
    where = {(p["role"], p["rank"]): p for p in placement}

    def endpoint(role: str, rank: int) -> Endpoint:
        p = where[(role, rank)]
        return Endpoint(p["node_id"], tuple(p["gpu_ids"]), devices[(role, rank)])

    policy = [endpoint("policy", r) for r in range(len(actors["policy"]))]
    engines = [endpoint("engine", i) for i in range(len(actors["engine"]))]
    transport = choose_transport(cfg.weight_sync, policy, engines, engine_direct=cfg.engine_direct,
                                 backend=cfg.weight_sync_backend)

    def wait(refs: list[Any], who: list[tuple[str, int]]) -> list[Any]:
        return wait_all(refs, [labels[m][r] for m, r in who], monitor, timeout=cfg.weight_sync_timeout_s + 60)

    transport.connect(SyncPeers(actors["policy"], [where[("policy", r)]["ip"] for r in range(len(policy))],
                                actors["engine"], [where[("engine", i)]["ip"] for i in range(len(engines))], wait,
                                cfg.weight_sync_timeout_s))
    return transport
