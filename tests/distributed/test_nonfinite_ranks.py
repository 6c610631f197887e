"""torchrun --nproc_per_node 2 (gloo, CPU): the non-finite decision is the same on every rank.

Rank 1 alone sees a non-finite loss (its gradients stay finite): both ranks skip the step. Then
rank 0 alone holds a NaN in its shard of the weights: both ranks refuse to save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import free_port, pythonpath
import torch

pytestmark = pytest.mark.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r'''
import json, os, sys
import torch
from torch import nn
from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel import init_distributed
from rlhfkit.backend.guard import NonFiniteError
from rlhfkit.config.configs import BackendConfig, OptimConfig

dist = init_distributed("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 1, bias=False))
b = FSDP2Backend(model, BackendConfig(param_dtype="fp32", zero_stage=3),
                 OptimConfig(learning_rate=1e-2, lr_scheduler="constant", lr_warmup_ratio=0.0), 4, dist)
out = {"rank": dist.rank, "skipped": []}
for step in range(2):
    loss = b.model(torch.ones(2, 4)).pow(2).mean()
    if step == 0 and dist.rank == 1:
        loss = loss + float("inf")
    b.backward(loss)
    out["skipped"].append(b.optimizer_step()["nonfinite_skipped"])
with torch.no_grad():
    if dist.rank == 0:
        next(b.model.parameters()).to_local()[0, 0] = float("nan")
try:
    b.save_checkpoint(sys.argv[1], "s", {}, max_keep=1)
    out["saved"] = True
except NonFiniteError as e:
    out["saved"] = False
    out["error"] = str(e)
with open(os.path.join(sys.argv[2], f"rank{dist.rank}.json"), "w") as f:
    json.dump(out, f)
torch.distributed.destroy_process_group()
'''



def test_ranks_take_the_same_decision(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(tmp_path / "ckpt"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for r in res:
        assert r["skipped"] == [1.0, 0.0], r
        assert r["saved"] is False, r
    assert "(0.weight)" in res[0]["error"]  # the rank holding the NaN names the tensor
    assert not os.path.exists(tmp_path / "ckpt")
