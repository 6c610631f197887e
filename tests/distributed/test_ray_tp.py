"""train_ppo_ray with a tensor-parallel engine (`--vllm_num_engines 1 --vllm_tensor_parallel_size 2`)
and two policy ranks == one-process train_ppo at the same global batch, colocated and not.

The engine is two shard actors (gloo between them on CPU); its shard 0 serves requests and mirrors
every step to shard 1. Each shard receives the full weights after every step (broadcast group of
policy rank 0 + both shards; colocated: the same, as CUDA IPC needs GPUs) and keeps its slice.

Tolerances (as tests/distributed/test_rl_torchrun.py, which compares 2 policy ranks with one
process): the two FSDP2 ranks reduce gradients in another order (~1e-7 relative per reduction)
and the sharded engine sums o / down products over its shards (log-probs within ~1e-6), so the
sampled tokens must be identical (statistics within 1e-6; one differing token moves the reward by
>= 1/48) and training metrics agree to rel 1e-4, final weights to 1e-5 (they move by > 1e-3).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import read_run as read
from helpers import rl_flags as flags
from test_ray_ppo import SAMPLE_KEYS, placement

ray = pytest.importorskip("ray")
from rlhfkit.cli import train_ppo, train_ppo_ray  # noqa: E402

# --dist loadgroup: one worker runs the modules on the local Ray, which starts once, not once a worker
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("local_ray")]

TRAIN_KEYS = ["train/policy_loss", "train/kl_loss", "train/kl", "train/advantage", "train/grad_norm"]
TP = ["--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "2", "--actor_num_gpus_per_node", "2",
      "--ray_num_cpus_per_worker", "0.5"]


@pytest.fixture(scope="module")
def reference(tiny_qwen2_dir, data_dir):
    save = os.path.join(data_dir, "one_process")
    train_ppo.main(flags(tiny_qwen2_dir, data_dir, save))
    return read(save)


def check(reference, recs, w) -> None:
    assert [r["step"] for r in recs] == [1, 2]
    for a, b in zip(reference[0], recs):
        for k in SAMPLE_KEYS:
            assert b[k] == pytest.approx(a[k], abs=1e-6), f"step {a['step']} {k}: sampled tokens differ"
        for k in TRAIN_KEYS:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), f"step {a['step']} {k}: {b[k]} != {a[k]}"
    assert max(abs(r["train/policy_loss"]) for r in recs) > 1e-3
    for k, v in reference[1].items():
        torch.testing.assert_close(w[k], v, atol=1e-5, rtol=0, msg=k)


@pytest.mark.parametrize("colocated", [False, True])
def test_tp2_engine_two_policy_ranks_match_one_process(tiny_qwen2_dir, data_dir, reference, local_ray, capsys,
                                                       colocated):
    save = os.path.join(data_dir, "colocated" if colocated else "separate")
    extra = ["--colocate_all_models", "--ref_num_gpus_per_node", "2", "--vllm_enable_sleep"] if colocated else []
    train_ppo_ray.main(flags(tiny_qwen2_dir, data_dir, save, *TP, *extra))
    out = capsys.readouterr().out
    where = placement(out)
    engines = [p for p in where if p["role"] == "engine"]
    assert len(engines) == 2 and len({p["pid"] for p in engines}) == 2, out[-3000:]
    assert len([p for p in where if p["role"] == "policy"]) == 2
    if colocated:
        assert {p["pool"] for p in where} == {"all"}
    recs, w = read(save)
    check(reference, recs, w)
    assert all(r["train/weight_sync_mb"] > 0.1 for r in recs)
    if colocated:
        assert all(r["time/engine_sleep"] > 0 for r in recs)


def test_tp_with_hf_engine_is_refused(tiny_qwen2_dir, data_dir, capsys):
    with pytest.raises(SystemExit):
        train_ppo_ray.main(flags(tiny_qwen2_dir, data_dir, os.path.join(data_dir, "x"), *TP,
                                 "--rollout_engine", "hf"))
    assert "--vllm_tensor_parallel_size 2 needs --rollout_engine builtin" in capsys.readouterr().err
