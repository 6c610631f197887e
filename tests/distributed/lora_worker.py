"""Worker for the sharded-LoRA test: one process (imported) or one torchrun rank each.

    torchrun --nproc_per_node 2 tests/distributed/lora_worker.py --model_dir D --out O

A LoRA policy as train_ppo / train_sft load it (`load_causal_lm(..., master_dtype="fp32")`, --param_dtype
bf16): the frozen base comes in bf16, the adapters in fp32. FSDP2 (ZeRO-3, bf16 compute on the CPU)
shards a group that mixes the two dtypes. Two optimizer steps with `fsdp2_worker.train_steps`; rank 0
writes `O/result.json`: the dtypes of the local shards, the losses, and the full adapter and base weights
(`O/weights.safetensors`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fsdp2_worker import make_batches, train_steps  # noqa: E402

from rlhfkit.backend import FSDP2Backend  # noqa: E402
from rlhfkit.parallel import init_distributed  # noqa: E402
from rlhfkit.checkpoint.files import save_tensors  # noqa: E402
from rlhfkit.parallel.dist import DistInfo  # noqa: E402
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig  # noqa: E402


def run(model_dir: str, dist: DistInfo, out: str | None) -> dict:
    from rlhfkit.models.loader import load_causal_lm

    model = load_causal_lm(ModelConfig(pretrain=model_dir, param_dtype="bf16", lora_rank=4, lora_alpha=8),
                           master_dtype="fp32")
    loaded = sorted({str(p.dtype) + ("/trainable" if p.requires_grad else "/frozen") for p in model.parameters()})
    optim = OptimConfig(learning_rate=1e-2, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0)
    b = FSDP2Backend(model, BackendConfig(zero_stage=3, param_dtype="bf16", device="cpu"), optim, 2, dist,
                     cpu_low_precision=True)
    losses, _ = train_steps(b, make_batches(2, model.config.vocab_size), dist)
    sharded = sorted({str(p.dtype) + ("/trainable" if p.requires_grad else "/frozen") for p in b.model.parameters()})
    full = {n: t.float() for n, t in b.full_state_dict().items()}  # a collective: every rank calls it
    res = {"loaded": loaded, "sharded": sharded, "losses": losses, "world": dist.world_size}
    if out and dist.rank == 0:
        save_tensors(os.path.join(out, "weights.safetensors"), full)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(res, f)
    return {**res, "weights": full}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)  # the same fresh adapters on every rank and in the reference
    dist = init_distributed("cpu")
    run(a.model_dir, dist, a.out)


if __name__ == "__main__":
    main()
