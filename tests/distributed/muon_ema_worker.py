"""Worker of test_muon_ema_sharded.py: `--optim muon` with `--enable_ema` on FSDP2 shards.

    torchrun --nproc_per_node 2 tests/distributed/muon_ema_worker.py --model_dir D --out O

Trains 3 steps at ZeRO-3 on the batches of fsdp2_worker (each rank its rows), saving a sharded
checkpoint after step 2; rank 0 writes the final weights (`weights.safetensors`) and the EMA
export (`ema/`, save_hf). Then a fresh backend loads the step-2 checkpoint and runs step 3 again:
`resumed.json` records whether its EMA export equals the first one. Run in one process (no
torchrun) it is the reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel import barrier, init_distributed
from rlhfkit.checkpoint.files import load_tensors, save_tensors
from rlhfkit.config.configs import BackendConfig, OptimConfig

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, BETA = 3, 0.7


def _fsdp2_worker():
    spec = importlib.util.spec_from_file_location("fsdp2_worker", os.path.join(HERE, "fsdp2_worker.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def new_backend(model_dir: str, dist) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = BackendConfig(zero_stage=3, param_dtype="fp32", device=dist.device, ema_decay=BETA)
    optim = OptimConfig(optim="muon", learning_rate=1e-3, muon_lr=0.02, l2=0.0, max_norm=0.0,
                        lr_scheduler="constant", lr_warmup_ratio=0.0)
    return FSDP2Backend(model, cfg, optim, STEPS, dist)


def run(model_dir: str, out: str, device: str = "cpu") -> None:
    w = _fsdp2_worker()
    dist = init_distributed(device)
    from transformers import AutoConfig

    batches = w.make_batches(STEPS, AutoConfig.from_pretrained(model_dir).vocab_size, seed=3)
    os.makedirs(out, exist_ok=True)
    b = new_backend(model_dir, dist)
    w.train_steps(b, batches[:2], dist)
    b.save_checkpoint(os.path.join(out, "ckpt"), "step2", {"step": 2}, 1)
    w.train_steps(b, batches[2:], dist)
    full = b.full_state_dict()
    if dist.rank == 0:
        save_tensors(os.path.join(out, "weights.safetensors"), full)
    b.save_hf(os.path.join(out, "ema"), dtype=torch.float32)
    c = new_backend(model_dir, dist)
    c.load_checkpoint(os.path.join(out, "ckpt"))
    w.train_steps(c, batches[2:], dist)
    c.save_hf(os.path.join(out, "ema_resumed"), dtype=torch.float32)
    barrier()
    if dist.rank == 0:
        a = load_tensors(os.path.join(out, "ema", "model.safetensors"))
        r = load_tensors(os.path.join(out, "ema_resumed", "model.safetensors"))
        with open(os.path.join(out, "resumed.json"), "w") as f:
            json.dump({"equal": all(torch.equal(a[k], r[k]) for k in a), "world_size": dist.world_size}, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model_dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    run(args.model_dir, args.out)
