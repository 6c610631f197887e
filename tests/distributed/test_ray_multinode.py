"""Multi-node placement on one machine: `ray.cluster_utils.Cluster` with 2 nodes x 2 fake GPUs
(a custom resource `fake_gpu`, counted by `--ray_accelerator_resource fake_gpu`).

- placement groups: `--actor_num_nodes 2 --actor_num_gpus_per_node 2` gets 2 slots on each node,
  ranks numbered node by node (ranks 0, 1 on one node, 2, 3 on the other);
- a run with the policy on 2 nodes x 1: the ranks land on different nodes, rank 0's rendezvous
  (gloo over TCP) joins them, and the result equals one-process train_ppo up to fp32 summation
  order (two partial sums all-reduced): rel 1e-4, as in test_rl_torchrun.py;
- placements that cannot fit fail at once (well under the placement timeout) naming the flags.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from helpers import ppo_flags
import torch
from safetensors.torch import load_file

from rlhfkit.cli import train_ppo
from rlhfkit.tasks.addition import addition_splits

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from rlhfkit.cli import train_ppo_ray  # noqa: E402
from rlhfkit.distributed.placement import PoolSpec, Shape, SlotResources, create_pool, remove_pools  # noqa: E402

# one worker runs the module: its tests share the two-node cluster
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("ray_two_nodes")]

REWARD_FILE = '''
def reward_func(queries, prompts, labels):
    rewards = [sum(ord(ch) % 2 == 0 for ch in q[len(p):]) / 6.0 for q, p in zip(queries, prompts)]
    return {"rewards": rewards, "scores": rewards}
'''


def flags(model: str, d: str, save: str, *extra: str) -> list[str]:
    return ppo_flags(model, os.path.join(d, "prompts.jsonl"), save, *extra, reward=os.path.join(d, "reward.py"),
                     label_key=None, max_steps=2, init_kl_coef=0, actor_learning_rate="1e-3", lr_warmup_ratio=0)


RAY_FLAGS = ("--ray_accelerator_resource", "fake_gpu", "--ray_num_cpus_per_worker", "0.5",
             "--ray_placement_timeout", "30")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("rl_ray_nodes"))
    rows, _ = addition_splits(8, 2, seed=3)
    with open(os.path.join(d, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"input": r["input"]}) + "\n" for r in rows)
    with open(os.path.join(d, "reward.py"), "w") as f:
        f.write(REWARD_FILE)
    return d


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():  # the shared local Ray of an earlier module (conftest.local_ray): end it
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"fake_gpu": 2},
                                                            "include_dashboard": False})
    # Cluster records its address in /tmp/ray/ray_current_cluster, where a plain ray.init() on this
    # machine looks for a running cluster: a train_ppo_ray run of another test process (xdist worker)
    # would join this cluster and hold its resources. Remove the record while it is ours.
    record = ray._private.utils.get_ray_address_file(None)

    def forget() -> None:
        if os.path.exists(record) and open(record).read().strip() == cluster.gcs_address:
            os.remove(record)

    forget()
    cluster.add_node(num_cpus=2, resources={"fake_gpu": 2})
    forget()
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    forget()


def test_ranks_are_numbered_node_by_node(two_nodes):
    pool = create_pool(PoolSpec("policy", Shape(2, 2, "actor"), ["policy"]), SlotResources("fake_gpu", 0.5), 30)
    try:
        a, b = pool.node_of_rank[0], pool.node_of_rank[2]
        assert a != b and pool.node_of_rank == [a, a, b, b]
        assert sorted(pool.bundle_of_rank) == [0, 1, 2, 3]
    finally:
        remove_pools([pool])


def test_policy_over_two_nodes_matches_one_process(tiny_model_dir, data_dir, two_nodes, capsys):
    save = os.path.join(data_dir, "two_nodes")
    train_ppo_ray.main(flags(tiny_model_dir, data_dir, save, "--actor_num_nodes", "2",
                             "--actor_num_gpus_per_node", "1", *RAY_FLAGS))
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("placement: policy")]
    nodes = {int(ln[3]): ln[7] for ln in lines}  # "placement: policy rank R pid P node N ..."
    assert sorted(nodes) == [0, 1] and nodes[0] != nodes[1], lines
    one = os.path.join(data_dir, "one_process")
    train_ppo.main(flags(tiny_model_dir, data_dir, one))
    with open(os.path.join(one, "metrics.jsonl")) as f1, open(os.path.join(save, "metrics.jsonl")) as f2:
        ref, got = [json.loads(x) for x in f1], [json.loads(x) for x in f2]
    assert [r["step"] for r in got] == [1, 2]
    assert max(abs(r["train/policy_loss"]) for r in ref) > 1e-3
    for a, b in zip(ref, got):
        assert b["train/reward"] == pytest.approx(a["train/reward"], abs=1e-6)
        for k in ("train/policy_loss", "train/advantage", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), f"step {a['step']} {k}: {b[k]} != {a[k]}"
    w1, w2 = load_file(os.path.join(one, "model.safetensors")), load_file(os.path.join(save, "model.safetensors"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)


THREE_RANKS = ("--rollout_batch_size", "6", "--train_batch_size", "12")  # batch sizes divisible by 3 ranks


@pytest.mark.parametrize("shape, message", [
    (("3", "1", *THREE_RANKS), "--actor_num_nodes 3 x --actor_num_gpus_per_node 1 needs 3 node(s) with 1 fake_gpu"),
    (("1", "3", *THREE_RANKS), "the cluster has 0 such node(s) of 2 (most fake_gpu on one node: 2)"),
    (("2", "2"), "the placement needs 5 fake_gpu (policy 4 + engines 1 slots x 1) but the cluster has 4"),
])
def test_placement_that_cannot_fit_fails_at_once(tiny_model_dir, data_dir, two_nodes, capsys, shape, message):
    t0 = time.monotonic()
    with pytest.raises(SystemExit):
        train_ppo_ray.main(flags(tiny_model_dir, data_dir, os.path.join(data_dir, "no_fit"), "--actor_num_nodes",
                                 shape[0], "--actor_num_gpus_per_node", shape[1], *shape[2:], *RAY_FLAGS))
    assert message in capsys.readouterr().err
    assert time.monotonic() - t0 < 10  # not the 30 s placement timeout
    assert ray.available_resources().get("fake_gpu") == 4  # nothing left reserved
