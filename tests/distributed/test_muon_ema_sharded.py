"""torchrun --nproc_per_node 2 (gloo, CPU), ZeRO-3: Muon on DTensor shards and the EMA of sharded
weights give what one process gives, and a sharded checkpoint carries the EMA (muon_ema_worker.py).

Muon's Newton-Schulz runs on the full matrices (DTensor redistributes the shards) in bf16, so the
weights agree with one process to the bf16 accuracy of the orthogonalised steps, not bit for bit:
within 12% of how far each tensor moved in 3 steps (2-8% seen; the quintic iteration amplifies
rounding in the gradient's small singular directions, and AdamW's first steps, -lr g / |g|, turn
small gradient differences into full-size ones). Orthogonalising each rank's shard on its own
instead would give a different matrix altogether.
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
from helpers import free_port, pythonpath  # noqa: E402

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))



def _worker():
    spec = importlib.util.spec_from_file_location("muon_ema_worker", os.path.join(HERE, "muon_ema_worker.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_ranks_match_one_process(tiny_model_dir, tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _worker().run(tiny_model_dir, one)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(HERE, "muon_ema_worker.py"),
           "--model_dir", tiny_model_dir, "--out", two]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    init = load_tensors(os.path.join(tiny_model_dir, "model.safetensors"))
    for name in ("weights.safetensors", os.path.join("ema", "model.safetensors")):
        a, b = load_tensors(os.path.join(one, name)), load_tensors(os.path.join(two, name))
        for k in init:  # relative to how far training moved the tensor (Frobenius norms)
            moved = (a[k] - init[k]).norm()
            assert (a[k] - b[k]).norm() <= 0.12 * moved + 1e-7, (name, k, float((a[k] - b[k]).norm() / moved))
    ema = load_tensors(os.path.join(two, "ema", "model.safetensors"))
    final = load_tensors(os.path.join(two, "weights.safetensors"))
    k = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ema[k], final[k]) and not torch.equal(ema[k], init[k])
    for out in (one, two):
        with open(os.path.join(out, "resumed.json")) as f:
            assert json.load(f)["equal"]  # resumed from the step-2 checkpoint: the same EMA export
