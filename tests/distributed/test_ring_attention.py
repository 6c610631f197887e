"""torchrun --nproc_per_node 2 and 4 (gloo, CPU): ring attention's output and dq, dk, dv on every rank
equal the same rank's part of float64 full attention within 1e-5 in fp32 (ring_attention_worker.py):
causal and not, GQA (4 query heads over 2 KV heads), an odd length that the split pads, the zig-zag
and contiguous layouts, one KV head per ring pass with query tiles of 3 rows, and a packed row of
four sequences (lengths 5, 1, 8, 5) against each sequence attended on its own. The rectangle path
(kernel="blocks", the driver of the CUDA kernels) equals the math path within 1e-6 (ring_blocks_worker.py)."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest
import torch
from helpers import subprocess_env, torchrun_cmd

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {"causal_gqa_odd", "noncausal_gqa_odd", "causal_contiguous", "causal_stride1_tiled", "packed_zigzag",
         "packed_contiguous", "packed_noncausal"}


@pytest.mark.parametrize("nproc", [2, 4])
def test_ring_matches_full_attention(nproc, tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cmd = torchrun_cmd(nproc, os.path.join(HERE, "ring_attention_worker.py"), "--out", str(tmp_path))
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    files = sorted(glob.glob(os.path.join(tmp_path, "rank*.json")))
    assert len(files) == nproc
    for path in files:
        with open(path) as f:
            res = json.load(f)
        assert set(res) == CASES
        for case, errs in res.items():
            assert set(errs) == {"out", "dq", "dk", "dv", "gathered"}
            for name, err in errs.items():
                assert err < 1e-5, (os.path.basename(path), case, name, err)


@pytest.mark.parametrize("nproc", [2, 4])
def test_rectangle_path_matches_math_path(nproc, tmp_path):
    """Packed (five sequences, one of length 1, padding), both layouts, one KV head per pass, causal or
    not, and the padded form with an odd length: out, dq, dk, dv of kernel="blocks" and "math" agree."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cmd = torchrun_cmd(nproc, os.path.join(HERE, "ring_blocks_worker.py"), "--out", str(tmp_path))
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(nproc):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            res = json.load(f)
        assert set(res) == {"packed_zigzag", "packed_contiguous", "packed_stride1", "packed_noncausal",
                            "padded_causal", "padded_noncausal"}
        for case, errs in res.items():
            assert set(errs) == {"out", "dq", "dk", "dv"}
            for name, err in errs.items():
                assert err < 1e-6, (rank, case, name, err)


def test_bench_runs_on_cpu():
    """bench/ring_attention.py on a ring of 2 over gloo with a tiny odd length: one JSON line."""
    bench = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "ring_attention.py")
    cmd = torchrun_cmd(2, bench, "--seq_len", "37", "--heads", "4", "--kv_heads", "2", "--head_dim", "8",
                       "--head_stride", "1", "--warmup", "0", "--iters", "1")
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert res["ranks"] == 2 and res["backend"] == "gloo" and res["local_len"] == 20  # 37 -> 40 over 4 chunks
    assert res["ms_fwd_bwd"] > 0 and res["tokens_per_s"] > 0


def test_hf_model_through_an_attention_hook(tmp_path):
    """A tiny Llama (GQA) with ring attention registered as its attention function on a ring of 2:
    logits, loss and ring-summed gradients equal one process's, padded (odd length) and packed
    (three sequences in one row against each run on its own) - ring_attention_hf_worker.py."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cmd = torchrun_cmd(2, os.path.join(HERE, "ring_attention_hf_worker.py"), "--out", str(tmp_path))
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            res = json.load(f)
        assert set(res) == {"padded", "packed"}
        for case, errs in res.items():
            assert set(errs) == {"logits", "loss", "grads"}
            for name, err in errs.items():
                assert err < 1e-5, (rank, case, name, err)
