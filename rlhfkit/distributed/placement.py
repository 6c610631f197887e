"""Placement plans for train_ppo_ray: role groups and engines -> Ray placement groups.

A *slot* is one accelerator: a GPU, or on a machine without GPUs one CPU worker (then the
`--*_num_gpus_per_node` flags count CPU workers), or a custom resource (`--ray_accelerator_resource`,
e.g. fake GPUs in tests). A slot's bundle is `{accelerator: 1, "CPU": cpus_per_worker}`
(`{"CPU": cpus_per_worker}` in CPU mode).

    plan_pools(shapes, engines, colocation flags)   -> [PoolSpec]   (checks; clear errors)
    check_fits(pools, resources)                    -> fails at once when the cluster can never hold them
                                                       (waits <= 10 s for resources still being freed)
    create_pool(spec, resources, timeout)           -> ReadyPool: placement group + rank -> bundle

Pools: without colocation every role group (policy, ref, critic, reward) and the engines get
their own placement group. `--colocate_actor_ref` puts policy and ref ranks on the same slots,
`--colocate_critic_reward` critic and reward, and `--colocate_all_models` every role and every
engine (engine i on slot i; needs engines x tensor-parallel size == policy slots). Actors
sharing a slot each take 1/k of it (fractional resources), so Ray puts them on the same GPU.

Nodes: a pool of `--X_num_nodes 1` is STRICT_PACK (all slots on one node); with several nodes it
is SPREAD and is checked afterwards to use exactly `num_nodes` nodes with `num_gpus_per_node`
slots each (ranks are numbered node by node, so rank 0's node holds ranks 0..k-1). Engines
(which need no process group) are PACKed anywhere.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

ROLE_FLAGS = {"policy": "actor", "ref": "ref", "critic": "critic", "reward": "reward"}


class PlacementError(ValueError):
    """A placement that is inconsistent or cannot fit the cluster; the message names the flags."""


@dataclass(frozen=True)
class Shape:
    """`num_nodes` x `per_node` slots of a role group (flags `--{flag}_num_nodes` / `_num_gpus_per_node`)."""

    num_nodes: int
    per_node: int
    flag: str = "actor"

    @property
    def slots(self) -> int:
        return self.num_nodes * self.per_node

    def describe(self) -> str:
        return (f"--{self.flag}_num_nodes {self.num_nodes} x --{self.flag}_num_gpus_per_node {self.per_node}")


@dataclass
class PoolSpec:
    """One placement group: `members` (roles, "engine") each have one actor per slot."""

    name: str
    shape: Shape
    members: list[str]
    strict_nodes: bool = True


@dataclass(frozen=True)
class SlotResources:
    accelerator: str = "CPU"  # "GPU", "CPU" or a custom resource name
    cpus: float = 1.0  # CPUs per slot

    def bundle(self) -> dict[str, float]:
        if self.accelerator == "CPU":
            return {"CPU": self.cpus}
        return {self.accelerator: 1.0, "CPU": self.cpus}

    def actor_options(self, share: int) -> dict[str, Any]:
        """Options of one of `share` actors sharing a slot (each takes 1/share of it)."""
        frac = _floor4(1.0 / share)
        opts: dict[str, Any] = {"num_cpus": _floor4(self.cpus * frac), "num_gpus": 0}
        if self.accelerator == "GPU":
            opts["num_gpus"] = frac
        elif self.accelerator != "CPU":
            opts["resources"] = {self.accelerator: frac}
        return opts


@dataclass
class ReadyPool:
    spec: PoolSpec
    pg: Any
    bundle_of_rank: list[int]
    node_of_rank: list[str] = field(default_factory=list)


def _floor4(x: float) -> float:
    """Ray wants fractional resources in steps of 1e-4; round down so k shares fit in one slot."""
    return math.floor(x * 10_000 + 1e-9) / 10_000


# ----------------------------------------------------------------------------- planning


def _same_shape(a: str, b: str, shapes: dict[str, Shape], flag: str) -> None:
    if shapes[a].slots and (shapes[a].num_nodes, shapes[a].per_node) != (shapes[b].num_nodes, shapes[b].per_node):
        raise PlacementError(f"{flag} needs {shapes[b].describe()} equal to {shapes[a].describe()}")


def plan_pools(shapes: dict[str, Shape], num_engines: int, tp: int, *, colocate_all: bool = False,
               colocate_actor_ref: bool = False, colocate_critic_reward: bool = False) -> list[PoolSpec]:
    """Pools for the roles present in `shapes` (keys: policy, ref, critic, reward) and the engines."""
    if "policy" not in shapes:
        raise PlacementError("a placement needs the policy")
    for role, s in shapes.items():
        if s.num_nodes < 1 or s.per_node < 1:
            raise PlacementError(f"{s.describe()}: both must be >= 1")
    if num_engines < 1 or tp < 1:
        raise PlacementError(f"--vllm_num_engines ({num_engines}) and --vllm_tensor_parallel_size ({tp}) "
                             "must be >= 1")
    if colocate_all:
        for role in shapes:
            if role != "policy":
                _same_shape("policy", role, shapes, "--colocate_all_models")
        slots = shapes["policy"].slots
        if num_engines * tp != slots:
            raise PlacementError(
                f"--colocate_all_models puts the engines on the policy's slots: --vllm_num_engines x "
                f"--vllm_tensor_parallel_size ({num_engines} x {tp} = {num_engines * tp}) must equal "
                f"{shapes['policy'].describe()} ({slots})")
        return [PoolSpec("all", shapes["policy"], [*shapes, "engine"])]
    pools: list[PoolSpec] = []
    done: set[str] = set()
    if colocate_actor_ref and "ref" in shapes:
        _same_shape("policy", "ref", shapes, "--colocate_actor_ref")
        pools.append(PoolSpec("policy+ref", shapes["policy"], ["policy", "ref"]))
        done |= {"policy", "ref"}
    if colocate_critic_reward and "critic" in shapes and "reward" in shapes:
        _same_shape("critic", "reward", shapes, "--colocate_critic_reward")
        pools.append(PoolSpec("critic+reward", shapes["critic"], ["critic", "reward"]))
        done |= {"critic", "reward"}
    for role, s in shapes.items():
        if role not in done:
            pools.append(PoolSpec(role, s, [role]))
    pools.append(PoolSpec("engines", Shape(1, num_engines * tp, "vllm"), ["engine"], strict_nodes=False))
    return pools


# ----------------------------------------------------------------------------- resources


def detect_accelerator(requested: str | None) -> str:
    """The resource a slot counts: `requested`, else GPU when the cluster has GPUs, else CPU."""
    total = ray.cluster_resources()
    if requested:
        if requested != "CPU" and total.get(requested, 0) <= 0:
            have = ", ".join(sorted(k for k in total if not k.startswith("node:")))
            raise PlacementError(f"--ray_accelerator_resource {requested}: the cluster has no such resource "
                                 f"(it has: {have})")
        return requested
    return "GPU" if total.get("GPU", 0) > 0 else "CPU"


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _fits(have: dict[str, float], bundle: dict[str, float], count: int) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v * count for k, v in bundle.items())


def _shortfall(need: dict[str, float], have: dict[str, float]) -> str | None:
    return next((k for k, v in need.items() if have.get(k, 0.0) + 1e-9 < v), None)


def check_fits(pools: list[PoolSpec], res: SlotResources, wait_s: float = 10.0) -> None:
    """Fail at once when the pools can never be placed on this cluster (too few nodes of the right
    size, or too few resources in total); when they fit the cluster's totals but not what is free
    now (e.g. a previous run's placement groups still being released), wait at most `wait_s`."""
    bundle = res.bundle()
    unit = "CPU workers" if res.accelerator == "CPU" else res.accelerator
    nodes = _alive_nodes()
    for p in pools:
        s = p.shape
        if not p.strict_nodes:
            continue
        able = [n for n in nodes if _fits(n.get("Resources", {}), bundle, s.per_node)]
        if len(able) < s.num_nodes:
            best = max((n.get("Resources", {}).get(res.accelerator, 0.0) for n in nodes), default=0.0)
            raise PlacementError(
                f"{p.name}: {s.describe()} needs {s.num_nodes} node(s) with {s.per_node} {unit} "
                f"(+{res.cpus:g} CPU each); the cluster has {len(able)} such node(s) of {len(nodes)} "
                f"(most {res.accelerator} on one node: {best:g})")
    need: dict[str, float] = {}
    for p in pools:
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v * p.shape.slots
    total = ray.cluster_resources()
    short = _shortfall(need, total)
    if short is None:
        deadline = time.monotonic() + wait_s
        while (short := _shortfall(need, ray.available_resources())) and time.monotonic() < deadline:
            time.sleep(0.2)
        if short is None:
            return
    parts = " + ".join(f"{p.name} {p.shape.slots}" for p in pools)
    hint = " (lower --ray_num_cpus_per_worker or colocate roles)" if short == "CPU" else ""
    raise PlacementError(f"the placement needs {need[short]:g} {short} ({parts} slots x {bundle.get(short):g}) "
                         f"but the cluster has {ray.available_resources().get(short, 0.0):g} available "
                         f"({total.get(short, 0.0):g} in total){hint}")


def create_pool(spec: PoolSpec, res: SlotResources, timeout_s: float) -> ReadyPool:
    """Reserve the pool's bundles; raise PlacementError if not ready within `timeout_s`."""
    s = spec.shape
    strategy = ("STRICT_PACK" if s.num_nodes == 1 else "SPREAD") if spec.strict_nodes else "PACK"
    pg = placement_group([res.bundle() for _ in range(s.slots)], strategy=strategy)
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise PlacementError(f"{spec.name}: {s.slots} bundles of {res.bundle()} ({strategy}) were not placed "
                             f"within {timeout_s:g} s; available now: {ray.available_resources()}")
    b2n = placement_group_table(pg)["bundles_to_node_id"]
    node_order: list[str] = []
    for i in range(s.slots):
        if b2n[i] not in node_order:
            node_order.append(b2n[i])
    order = sorted(range(s.slots), key=lambda i: (node_order.index(b2n[i]), i))
    if spec.strict_nodes and s.num_nodes > 1:
        counts = [sum(1 for i in range(s.slots) if b2n[i] == n) for n in node_order]
        if len(node_order) != s.num_nodes or any(c != s.per_node for c in counts):
            remove_placement_group(pg)
            raise PlacementError(f"{spec.name}: Ray spread {s.describe()} over {len(node_order)} node(s) with "
                                 f"{counts} slots; it needs {s.num_nodes} nodes of {s.per_node}")
    return ReadyPool(spec, pg, order, [b2n[i] for i in order])


def remove_pools(pools: list[ReadyPool], wait_s: float = 10.0) -> None:
    """Remove the placement groups (their actors die) and wait until Ray reports them removed, so
    a following placement in the same cluster sees the resources free."""
    removed = []
    for p in pools:
        try:
            remove_placement_group(p.pg)
            removed.append(p.pg)
        except Exception:  # already gone with the cluster
            pass
    deadline = time.monotonic() + wait_s
    for pg in removed:
        while time.monotonic() < deadline:
            try:
                if placement_group_table(pg).get("state") == "REMOVED":
                    break
            except Exception:
                break
            time.sleep(0.05)
