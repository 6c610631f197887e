"""torchrun --nproc_per_node 2 (gloo, CPU) FSDP2 == one process with the same global batch.

One torchrun launch trains ZeRO stages 3, 2 and 0 for 5 steps each (4 rows per rank, 2 micro-
batches, gradient sync on the last), plus sharded-checkpoint resumes, weight iteration and a
streamed HF export; the reference is `fsdp2_worker.train_steps` in this process (8 rows, 4
micro-batches), which also saves a step-3 checkpoint for the 1 -> 2 rank resume.

Checkpoints across world sizes: loading restores the saved weights and AdamW state bit for bit
(resharding moves values, it does not compute); the steps after it then match the uninterrupted
run of the other world size as closely as 2 ranks match 1 rank (reduction order).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from rlhfkit.checkpoint.files import load_tensors
from rlhfkit.parallel.dist import DistInfo
from helpers import free_port, pythonpath  # noqa: E402

# --dist loadgroup: one worker builds its one- and two-rank runs, not each worker that runs one of the tests
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("fsdp2_equivalence")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STEPS = 5


def _worker():
    spec = importlib.util.spec_from_file_location("fsdp2_worker", os.path.join(HERE, "fsdp2_worker.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod



@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory) -> dict:
    """Steps 1-5 in this process, with a checkpoint after step 3 (saving changes nothing)."""
    w = _worker()
    from transformers import AutoConfig

    torch.manual_seed(0)
    batches = w.make_batches(STEPS, AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    dist = DistInfo(device="cpu")
    b = w.new_backend(tiny_model_dir, 2, dist, STEPS)
    losses, norms = w.train_steps(b, batches[:3], dist)
    ckpt_root = str(tmp_path_factory.mktemp("one_rank_ckpt"))
    b.save_checkpoint(ckpt_root, "step3", {"step": 3}, max_keep=1)
    step3 = {k: v.clone() for k, v in b.full_state_dict().items()}
    more_losses, more_norms = w.train_steps(b, batches[3:], dist)
    return {"losses": losses + more_losses, "norms": norms + more_norms, "ckpt": ckpt_root, "step3": step3,
            "weights": {k: v.clone() for k, v in b.full_state_dict().items()}, "batches": batches}


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory, one_rank) -> tuple[str, dict]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = str(tmp_path_factory.mktemp("fsdp2_two_ranks"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(HERE, "fsdp2_worker.py"), "--model_dir", tiny_model_dir, "--out", out,
           "--steps", str(STEPS), "--zero_stages", "3,2,0", "--resume_ckpt", one_rank["ckpt"]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(os.path.join(out, "results.json")) as f:
        return out, json.load(f)


@pytest.mark.parametrize("stage", ["3", "2", "0"])
def test_two_ranks_match_one_process(two_ranks, one_rank, stage):
    out, res = two_ranks
    losses, norms, weights = one_rank["losses"], one_rank["norms"], one_rank["weights"]
    assert res["world_size"] == 2
    got = res["stages"][stage]
    # one named mesh from ParallelDims; FSDP2 shards over its data-parallel dims
    assert got["mesh"] == [["dp_replicate", "dp_shard", "cp", "tp"], [2, 1, 1, 1] if stage == "0" else [1, 2, 1, 1]]
    assert got["param_mesh_dims"] == (["dp_replicate", "dp_shard"] if stage == "0" else ["dp_shard"])
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    # gradients summed (not averaged) over ranks: the norms match the one-process norms
    assert got["grad_norms"] == pytest.approx(norms, rel=1e-5)
    final = load_tensors(os.path.join(out, f"stage{stage}.safetensors"))
    assert final.keys() == weights.keys()
    for k in weights:
        torch.testing.assert_close(final[k], weights[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("stage", ["3", "2", "0"])
def test_sleep_round_trip_of_sharded_states(two_ranks, stage):
    sleep = two_ranks[1]["stages"][stage]["sleep"]
    # after a no-grad forward some parameters stay gathered (the root at every stage, the blocks too
    # at stages < 3): offload_states reshards before it moves the shards
    assert sleep["gathered_after_forward"]
    assert sleep["freed"] and sleep["equal"]
    assert sleep["bytes"] > 0  # the final weights (test above) are those of the run with this sleep in it


def test_weights_moved(two_ranks, tiny_model_dir):
    out, _ = two_ranks
    init = load_tensors(os.path.join(tiny_model_dir, "model.safetensors"))
    final = load_tensors(os.path.join(out, "stage3.safetensors"))
    assert max((final[k] - init[k]).abs().max().item() for k in init) > 1e-3


def test_sharded_resume_weight_iteration_and_hf_export(two_ranks, tiny_model_dir):
    out, res = two_ranks
    assert res["client_state"] == {"step": 3}
    assert res["resume_max_diff"] == 0.0  # resumed at step 3 == uninterrupted, bit for bit
    assert res["resumed_losses"] == res["uninterrupted_losses"]
    assert res["named_max_diff"] == 0.0 and res["named_keys_missing"] == []
    # the run with a checkpoint + offload/reload in the middle ends where the plain run ends
    resumed = load_tensors(os.path.join(out, "resume_final.safetensors"))
    plain = load_tensors(os.path.join(out, "stage3.safetensors"))
    assert all(torch.equal(resumed[k], plain[k]) for k in plain)
    # each rank wrote its own shard file, about half of the state each: nothing gathered on rank 0
    files = res["dcp_files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    both = files["__0_0.distcp"] + files["__1_0.distcp"]
    assert max(files["__0_0.distcp"], files["__1_0.distcp"]) < 0.6 * both
    state_bytes = 3 * 4 * sum(t.numel() for t in plain.values())  # fp32 weights + exp_avg + exp_avg_sq
    assert state_bytes <= both < 1.2 * state_bytes


def test_streamed_hf_export_from_two_ranks(two_ranks):
    out, res = two_ranks
    assert res["hf_full_state_dict_calls"] == 0
    assert res["hf_logits_max_diff"] == 0.0  # reloaded with from_pretrained: the trained weights
    hf = os.path.join(out, "hf")
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(n for n in os.listdir(hf) if n.endswith(".safetensors"))
    assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
    assert all(n == f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, n in enumerate(shards))
    plain = load_tensors(os.path.join(out, "stage3.safetensors"))
    assert set(index["weight_map"]) == set(plain)
    assert index["metadata"]["total_size"] == 4 * sum(t.numel() for t in plain.values())


def test_two_rank_checkpoint_resumes_on_one_rank(two_ranks, one_rank, tiny_model_dir):
    out, res = two_ranks
    w = _worker()
    dist = DistInfo(device="cpu")
    b = w.new_backend(tiny_model_dir, 3, dist, STEPS)
    assert b.load_checkpoint(os.path.join(out, "ckpt")) == {"step": 3}
    saved = load_tensors(os.path.join(out, "step3.safetensors"))
    loaded = b.full_state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # resharded 2 -> 1, bit for bit
    saved_opt = torch.load(os.path.join(out, "optim_step3.pt"), weights_only=True)
    opt = b.optimizer_state_dict()
    assert opt["state"].keys() == saved_opt["state"].keys()
    for name, st in saved_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(opt["state"][name][k], v), (name, k)
    losses, _ = w.train_steps(b, one_rank["batches"][3:], dist)
    assert losses == pytest.approx(res["uninterrupted_losses"], rel=1e-5)
    final = load_tensors(os.path.join(out, "resume_final.safetensors"))
    got = b.full_state_dict()
    for k in final:
        torch.testing.assert_close(got[k], final[k], atol=1e-6, rtol=0)


def test_one_rank_checkpoint_resumes_on_two_ranks(two_ranks, one_rank):
    out, res = two_ranks
    other = res["other_world"]
    assert other["client_state"] == {"step": 3}
    loaded = load_tensors(os.path.join(out, "other_world_loaded.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in one_rank["step3"].items())  # resharded 1 -> 2
    assert other["losses"] == pytest.approx(one_rank["losses"][3:], rel=1e-5)
    final = load_tensors(os.path.join(out, "other_world_final.safetensors"))
    for k, v in one_rank["weights"].items():
        torch.testing.assert_close(final[k], v, atol=1e-6, rtol=0)
