"""Sleep round trip of FSDP2 training states (--deepspeed_enable_sleep): host-buffer stash vs the old path.

    torchrun --nproc_per_node 2 bench/offload.py --shape qwen2.5-7b --out bench/results/offload_h100x2.json
    torchrun --nproc_per_node 1 bench/offload.py --shape qwen2.5-3b --out bench/results/offload_3b_h100.json
    torchrun --nproc_per_node 2 bench/offload.py --shape tiny --device cpu

Every rank builds the shape's model (random init, fp32 master weights, bf16 compute, ZeRO-2, the
policy's FSDP2Backend), runs one optimizer step so that Adam's states exist, then times per round
(seconds as the slowest rank saw them, bytes per rank):

    stash      FSDP2Backend.offload_states / reload_states (backend/offload.py): storages copied into
               host buffers allocated at the first round and reused (pinned with cudaHostRegister),
               on a side stream, one sync; round 1 includes allocating and pinning those buffers
    legacy     what offload_states did before (module.to("cpu"), every Adam state .to("cpu"), sync,
               empty_cache; back with .to(device)): fresh pageable host memory every round

and checks that every parameter shard and Adam state is bit-identical after each stash round trip,
and how much GPU memory the offload frees. The stash runs first (the legacy rounds leave
pageable memory behind). One JSON line; `--out` writes it with the GPU's name and count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness

from bench.harness.models import QWEN2_05B, STREAMED, TINY  # noqa: E402

# Qwen2.5-3B's shape: its 37 GB of fp32 states fit one 80 GB GPU (the 7B's 91 GB need >= 2 ranks)
QWEN25_3B = dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
SHAPES = {"tiny": {**TINY, "vocab_size": 512}, "qwen2-0.5b": QWEN2_05B, "qwen2.5-3b": QWEN25_3B, **STREAMED}


def build(shape: str, device: str, dist):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.config.configs import BackendConfig, OptimConfig

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    bcfg = BackendConfig(zero_stage=2, param_dtype="bf16", device=device, gradient_checkpointing=True)
    optim = OptimConfig(learning_rate=1e-6, lr_scheduler="constant", lr_warmup_ratio=0.0)
    return FSDP2Backend(model, bcfg, optim, 10, dist), cfg.vocab_size


def train_step(b, vocab: int, tokens: int) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, tokens), generator=g).to(b.device)
    logits = b.model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    b.backward(loss)
    b.optimizer_step()


def local_states(b) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = [p.to_local() if isinstance(p, DTensor) else p for p in b.model.parameters()]
    for s in b.optimizer.state.values():
        out += [v.to_local() if isinstance(v, DTensor) else v for v in s.values()]
    return [t.detach() for t in out]


def legacy_offload(b) -> None:
    b.model.to("cpu")
    for state in b.optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and not (k == "step" and v.device.type == "cpu"):
                state[k] = v.to("cpu", non_blocking=True)
    if b.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def legacy_reload(b) -> None:
    b.model.to(b.device)
    for state in b.optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and not (k == "step" and v.device.type == "cpu"):
                state[k] = v.to(b.device, non_blocking=True)
    if b.device.type == "cuda":
        torch.cuda.synchronize()


def slowest(x: float) -> float:
    from rlhfkit.parallel.dist import get_world_size

    t = torch.tensor([x], dtype=torch.float64)
    if get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return round(float(t[0]), 4)


def mem_gib(device: str) -> float:
    return round(torch.cuda.memory_allocated() / 2**30, 2) if device.startswith("cuda") else 0.0


def timed(fn) -> float:
    from rlhfkit.parallel.dist import barrier

    barrier()
    t0 = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from rlhfkit.parallel.dist import init_distributed

    dist = init_distributed(a.device)
    b, vocab = build(a.shape, dist.device, dist)
    train_step(b, vocab, a.tokens)
    nbytes = sum(t.untyped_storage().nbytes() for t in local_states(b))
    res = {"bench": "offload", "shape": a.shape, "ranks": dist.world_size, "zero_stage": 2,
           "device": torch.cuda.get_device_name() if dist.device.startswith("cuda") else "cpu",
           "state_gib_per_rank": round(nbytes / 2**30, 3), "mem_gib_awake": mem_gib(dist.device),
           "stash": [], "legacy": []}
    for r in range(a.rounds):
        before = [t.clone() for t in local_states(b)] if r == 0 else None
        off = timed(b.offload_states)
        asleep = mem_gib(dist.device)
        on = timed(b.reload_states)
        same = before is None or all(torch.equal(x, y) for x, y in zip(before, local_states(b)))
        st = b.sleep_stats
        res["stash"].append({"offload_s": off, "reload_s": on, "gib": round(st["offload_bytes"] / 2**30, 3),
                             "mem_gib_asleep": asleep, "bit_identical": same,
                             "host_buffers": len(b.offloader.stash.buffers), "pinned": b.offloader.stash.pin})
        del before
    train_step(b, vocab, a.tokens)  # the stashed states train on
    for r in range(a.rounds):
        off = timed(lambda: legacy_offload(b))
        asleep = mem_gib(dist.device)
        on = timed(lambda: legacy_reload(b))
        res["legacy"].append({"offload_s": off, "reload_s": on, "mem_gib_asleep": asleep})
    for k in ("stash", "legacy"):
        rest = res[k][1:] or res[k]
        res[f"{k}_offload_s"] = sum(x["offload_s"] for x in rest) / len(rest)
        res[f"{k}_reload_s"] = sum(x["reload_s"] for x in rest) / len(rest)
    gib = res["state_gib_per_rank"]
    res["stash_gib_per_s"] = {"offload": round(gib / res["stash_offload_s"], 2),
                              "reload": round(gib / res["stash_reload_s"], 2)}
    res["speedup_vs_legacy"] = {"offload": round(res["legacy_offload_s"] / res["stash_offload_s"], 2),
                                "reload": round(res["legacy_reload_s"] / res["stash_reload_s"], 2)}
    if dist.rank == 0:
        line = json.dumps(res)
        print(line, flush=True)
        if a.out:
            with open(a.out, "w") as f:
                f.write(json.dumps(res, indent=1) + "\n")
    if dist.has_process_group:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
