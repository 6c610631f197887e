"""Worker for the streamed-loading test: one torchrun rank each (or one process without torchrun).

    torchrun --nproc_per_node 2 tests/distributed/stream_load_worker.py --model_dir D --out O [--whole]

Loads D as train_sft / train_ppo load the policy (`load_causal_lm(..., master_dtype="fp32",
defer_weights=True)`, then FSDP2Backend at ZeRO-3: the model is built on the meta device, sharded, and
each rank streams in only its shards) and measures the peak of this process's resident memory (VmHWM,
reset through /proc/self/clear_refs before loading) against the bytes the rank keeps. Then one
optimizer step. Rank 0 compares the gathered weights with transformers' `from_pretrained` (fp32) and
writes O/result.json. `--whole`: the model loaded whole on every rank first (`defer_weights=False`),
for comparison.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig
from rlhfkit.models.stream_load import has_pending_weights
from rlhfkit.parallel import init_distributed
from rlhfkit.utils.host_memory import reset_peak, status_bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--whole", action="store_true")
    a = ap.parse_args()
    dist = init_distributed("cpu")
    from transformers import AutoModelForCausalLM

    from rlhfkit.models.loader import load_causal_lm
    from rlhfkit.models.stream_load import build_meta_model

    build_meta_model(AutoModelForCausalLM, a.model_dir, torch.float32)  # the imports loading does (a constant)
    reset_peak()  # the peak (VmHWM) starts again from the current RSS
    before = status_bytes("VmRSS")
    model = load_causal_lm(ModelConfig(pretrain=a.model_dir, param_dtype="bf16"), master_dtype="fp32",
                           defer_weights=not a.whole)
    deferred = has_pending_weights(model)
    optim = OptimConfig(learning_rate=1e-3, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0)
    backend = FSDP2Backend(model, BackendConfig(zero_stage=3, param_dtype="bf16", device="cpu"), optim, 2, dist)
    peak = status_bytes("VmHWM") - before
    kept = sum(_local(p).numel() * _local(p).element_size() for p in backend.model.parameters())
    kept += sum(b.numel() * b.element_size() for b in backend.model.buffers())
    res = {"rank": dist.rank, "world": dist.world_size, "deferred": deferred, "peak_extra": peak, "kept": kept}
    loaded = backend.full_state_dict()  # a collective; rank 0 gets the full tensors
    if dist.rank == 0:
        ref = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).state_dict()
        res["full_bytes"] = sum(t.numel() * t.element_size() for t in ref.values())
        res["keys_equal"] = sorted(loaded) == sorted(ref)
        res["unequal"] = [k for k in ref if k not in loaded or not torch.equal(loaded[k], ref[k])]
    del loaded
    first = next(p for p in backend.model.parameters() if p.requires_grad)
    start = _local(first).detach().clone()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    loss = backend.forward(ids, labels=ids).loss
    backend.backward(loss)
    stats = backend.optimizer_step()
    res.update(loss=float(loss.detach()), skipped=stats["skipped"], grad_norm=stats["grad_norm"],
               moved=not torch.equal(_local(first).detach(), start))
    path = os.path.join(a.out, f"rank{dist.rank}.json")
    with open(path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
