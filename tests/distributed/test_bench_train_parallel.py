"""bench/train_parallel.py under torchrun on CPU (2 ranks, gloo, the tiny shape, fp32): the JSON it writes.

    throughput, TP 1 (dp 2) and TP 2 (dp 1) on the same global batch (2 rows x 32 tokens): every rank
        reports the same global loss for each of the 3 steps (1 warm-up + 2 timed, each with an optimizer
        step), the two meshes agree on it within 1e-5, and the first loss is the NLL of a near-uniform
        guess over the 512-token vocabulary (ln 512: a loss counted twice over dp or not divided by the
        global count would be far off)
    longest, TP 2, lengths 16, 32, 64 with a simulated out-of-memory above 32: stops at 64 with
        longest_seq 32, every rank reporting the error
    --ring_attn_size 2: refused (JSON "error") until context parallelism exists; once it does, it must
        give the TP 1 losses too
"""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import torch
from helpers import subprocess_env, torchrun_cmd

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "bench", "train_parallel.py")
TOL = 1e-5


def launch(tmp_path, name: str, *args: str) -> dict:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = str(tmp_path / f"{name}.json")
    cmd = torchrun_cmd(2, SCRIPT, "--device", "cpu", "--model", "tiny", "--out", out, *args)
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=180,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


def throughput(tmp_path, name: str, *args: str) -> dict:
    return launch(tmp_path, name, "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "2", *args)


def check_throughput(res: dict, tp: int) -> list[float]:
    assert res["error"] is None, res["error"]
    assert (res["bench"], res["mode"], res["device"], res["world_size"]) == ("train_parallel", "throughput", "cpu", 2)
    assert res["ds_tensor_parallel_size"] == tp and res["dp"] == 2 // (tp * res["ring_attn_size"])
    assert res["rows_per_dp_rank"] * res["dp"] == res["batch"] == 2
    assert res["step_s"] > 0 and res["tokens_per_s"] == pytest.approx(2 * 32 / res["step_s"])
    assert res["tokens_per_s_per_gpu"] == pytest.approx(res["tokens_per_s"] / 2)
    assert res["mfu"] is None  # no peak flops for a CPU
    assert len(res["peak_mem_gb"]) == 2 and min(res["peak_mem_gb"]) > 0
    losses = res["loss_by_rank"]
    assert len(losses) == 2 and all(len(r) == 3 for r in losses)
    for a, b in zip(*losses):
        assert a == pytest.approx(b, abs=1e-7)  # every rank's view of the global loss
    return losses[0]


def test_throughput_tp1_tp2_same_losses_and_ring_passthrough(tmp_path):
    l1 = check_throughput(throughput(tmp_path, "tp1"), 1)
    l2 = check_throughput(throughput(tmp_path, "tp2", "--ds_tensor_parallel_size", "2"), 2)
    assert l1[0] == pytest.approx(math.log(512), abs=0.15), l1
    assert l1[2] < l1[0] - 1e-3  # the optimizer steps moved the weights (AdamW, lr 1e-5)
    for a, b in zip(l1, l2):
        assert a == pytest.approx(b, abs=TOL), (l1, l2)

    ring = throughput(tmp_path, "ring2", "--ring_attn_size", "2")
    assert ring["ring_attn_size"] == 2
    if ring["error"] is not None:  # before context parallelism: recorded, not crashed
        assert "--ring_attn_size 2" in ring["error"] and "loss_by_rank" not in ring
    else:
        for a, b in zip(l1, check_throughput(ring, 1)):
            assert a == pytest.approx(b, abs=TOL)


def test_longest_stops_at_first_out_of_memory(tmp_path):
    res = launch(tmp_path, "long", "--mode", "longest", "--ds_tensor_parallel_size", "2", "--lengths", "16:64",
                 "--long_steps", "1", "--fake_oom_above", "32")
    assert res["error"] is None and res["lengths"] == [16, 32, 64]
    tried = res["tried"]
    assert [t["seq"] for t in tried] == [16, 32, 64] and [t["ok"] for t in tried] == [True, True, False]
    assert "out of memory" in tried[2]["error"] and tried[2]["oom_ranks"] == [0, 1]
    assert (res["longest_seq"], res["stopped_at"], res["stop_reason"]) == (32, 64, "out of memory")
    assert res["complete"] is True  # ended by itself (a run killed mid-length leaves false)
    assert res["longest_tokens_per_s_per_gpu"] == pytest.approx(32 / res["longest_step_s"] / 2)  # dp 1: one row
    assert len(tried[1]["peak_mem_gb"]) == 2 and res["longest_peak_mem_gb"] == max(tried[1]["peak_mem_gb"])
