"""Worker for the FSDP2 equivalence tests: one process (imported) or one torchrun rank each.

    torchrun --nproc_per_node 2 tests/distributed/fsdp2_worker.py --model_dir D --out O [--device cuda]

For each `--zero_stages` entry it trains a fresh copy of the model for `--steps` optimizer steps
on the same global batches as the single-process reference (each rank takes its share of rows,
2 rows per micro-batch, gradient sync only on the last micro-batch), with a token-sum loss
divided by the global token count. Rank 0 writes `O/stage<k>.safetensors` (final weights) and
`O/results.json` (loss curves, grad norms and the extra checks of the first stage: sharded
checkpoint resume on the same ranks and, with `--resume_ckpt`, from a checkpoint saved by another
world size, `named_full_params` = `full_state_dict`, streamed `save_hf` reload logits, offload/reload),
and per stage a sleep round trip after training (`sleep_check`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil

import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel import all_reduce_sum, barrier, init_distributed
from rlhfkit.checkpoint.files import save_tensors
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config.configs import BackendConfig, OptimConfig

GLOBAL_BATCH, MICRO, SEQ, PROMPT = 8, 2, 16, 3
HF_SHARD_BYTES = 64 * 1024  # several safetensors files for the ~600 KB fp32 tiny model


def make_batches(steps: int, vocab: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Global batches of right-padded rows with different lengths and a loss mask after the prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(6, vocab, (GLOBAL_BATCH, SEQ), generator=g)
        lens = torch.randint(PROMPT + 2, SEQ + 1, (GLOBAL_BATCH,), generator=g)
        attn = (torch.arange(SEQ)[None, :] < lens[:, None]).long()
        ids = ids * attn
        loss_mask = attn.clone()
        loss_mask[:, :PROMPT] = 0
        out.append({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask})
    return out


def token_loss(model: torch.nn.Module, micro: dict[str, torch.Tensor], global_tokens: float,
               device: torch.device) -> torch.Tensor:
    """-sum of masked token log-probs of this micro-batch / global token count."""
    ids = micro["input_ids"].to(device)
    logits = model(input_ids=ids, attention_mask=micro["attention_mask"].to(device)).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = micro["loss_mask"][:, 1:].to(device).float()
    return -(tok * mask).sum() / global_tokens


def train_steps(backend: FSDP2Backend, batches: list[dict[str, torch.Tensor]], dist: DistInfo,
                micro: int = MICRO) -> tuple[list[float], list[float]]:
    """One optimizer step per global batch; returns the global loss and grad norm of each step."""
    losses, norms = [], []
    per_rank = GLOBAL_BATCH // dist.world_size
    for batch in batches:
        global_tokens = float(batch["loss_mask"][:, 1:].sum())
        rows = slice(dist.rank * per_rank, (dist.rank + 1) * per_rank)
        local = {k: v[rows] for k, v in batch.items()}
        n_micro = per_rank // micro
        step_loss = 0.0
        for i in range(n_micro):
            mb = {k: v[i * micro:(i + 1) * micro] for k, v in local.items()}
            loss = token_loss(backend.model, mb, global_tokens, backend.device)
            backend.backward(loss, sync_grads=(i == n_micro - 1))
            step_loss += loss.item()
        stats = backend.optimizer_step()
        losses.append(all_reduce_sum(step_loss))
        norms.append(stats["grad_norm"])
    return losses, norms


def optim_cfg() -> OptimConfig:
    # eps 1e-6: Adam's first steps divide tiny gradients by their own size; a larger eps keeps
    # fp32 rounding differences (reduction order) from being amplified in the weight comparison.
    return OptimConfig(learning_rate=1e-3, l2=0.01, adam_eps=1e-6, lr_scheduler="cosine_with_min_lr",
                       lr_warmup_ratio=0.2, min_lr_ratio=0.1, max_norm=1.0)


def new_backend(model_dir: str, stage: int, dist: DistInfo, steps: int,
                param_dtype: str = "fp32", adam_offload: bool = False) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = BackendConfig(zero_stage=stage, param_dtype=param_dtype, device=dist.device,
                        adam_offload=adam_offload)
    return FSDP2Backend(model, cfg, optim_cfg(), steps, dist)


def _local_states(b: FSDP2Backend) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"p.{n}": local(p) for n, p in b.model.named_parameters()}
    for i, st in enumerate(b.optimizer.state.values()):
        out.update({f"o.{i}.{k}": local(v) for k, v in st.items()})
    return out


def sleep_check(b: FSDP2Backend, batch: dict[str, torch.Tensor]) -> dict:
    """A no-grad forward (as forward_logprobs; at stage < 3 it leaves the blocks gathered), then
    offload -> reload: are the local shards and Adam states freed while asleep and equal after?"""
    from torch.distributed.tensor import DTensor

    before = _local_states(b)  # after a training step everything is resharded
    with torch.no_grad():
        b.model(input_ids=batch["input_ids"][:2].to(b.device))
    gathered = any(not isinstance(p, DTensor) for p in b.model.parameters())
    st = b.offload_states()
    freed = all((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() == 0
                for p in b.model.parameters())
    b.reload_states()
    after = _local_states(b)
    return {"gathered_after_forward": gathered, "freed": freed, "bytes": st.nbytes,
            "equal": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)}


def extra_checks(model_dir: str, out: str, stage: int, dist: DistInfo, steps: int,
                 batches: list[dict[str, torch.Tensor]], res: dict) -> None:
    """Resume from a sharded checkpoint at step 3, weight iteration, streamed HF export, offload/reload."""
    ckpt_root = os.path.join(out, "ckpt")
    b = new_backend(model_dir, stage, dist, steps)
    train_steps(b, batches[:3], dist)
    b.save_checkpoint(ckpt_root, "step3", {"step": 3}, max_keep=2)
    step3, optim3 = b.full_state_dict(), b.optimizer_state_dict()  # references for the 2 -> 1 resume
    if dist.rank == 0:
        save_tensors(os.path.join(out, "step3.safetensors"), step3)
        torch.save(optim3, os.path.join(out, "optim_step3.pt"))
        dcp_dir = os.path.join(ckpt_root, "step3", "dcp")
        res["dcp_files"] = {n: os.path.getsize(os.path.join(dcp_dir, n)) for n in os.listdir(dcp_dir)}
    del step3, optim3
    gc.collect()  # FSDP modules of earlier runs sit in reference cycles
    mem = [torch.cuda.memory_allocated() if torch.cuda.is_available() else 0]
    b.offload_states()
    mem.append(torch.cuda.memory_allocated() if torch.cuda.is_available() else 0)
    b.reload_states()
    res["cuda_mem_before_during_offload"] = mem
    res["uninterrupted_losses"], _ = train_steps(b, batches[3:], dist)
    full = b.full_state_dict()
    named = {n: t.cpu() for n, t in b.named_full_params()}
    hf_dir = os.path.join(out, "hf")
    gathers = []
    b.full_state_dict = lambda: gathers.append(1) or {}  # the streamed export must not gather it
    b.save_hf(hf_dir, dtype=torch.float32, max_shard_size=HF_SHARD_BYTES)
    res["hf_full_state_dict_calls"] = len(gathers)
    r = new_backend(model_dir, stage, dist, steps)
    client = r.load_checkpoint(ckpt_root)
    res["resumed_losses"], _ = train_steps(r, batches[3:], dist)
    resumed = r.full_state_dict()
    if dist.rank == 0:
        res["client_state"] = client
        res["resume_max_diff"] = max((full[k] - resumed[k]).abs().max().item() for k in full)
        res["named_max_diff"] = max((named[k] - full[k]).abs().max().item() for k in named)
        res["named_keys_missing"] = sorted(set(full) - set(named))
        res["hf_logits_max_diff"] = _hf_logits_diff(hf_dir, full, batches[0])
        save_tensors(os.path.join(out, "resume_final.safetensors"), full)
    barrier()


def resume_from_other_world(model_dir: str, ckpt_root: str, out: str, stage: int, dist: DistInfo,
                            steps: int, batches: list[dict[str, torch.Tensor]], res: dict) -> None:
    """Load a checkpoint saved by one process at step 3 onto these ranks, train steps 4-5."""
    r = new_backend(model_dir, stage, dist, steps)
    client = r.load_checkpoint(ckpt_root)
    loaded = r.full_state_dict()
    losses, _ = train_steps(r, batches[3:], dist)
    final = r.full_state_dict()
    if dist.rank == 0:
        res["other_world"] = {"client_state": client, "losses": losses}
        save_tensors(os.path.join(out, "other_world_loaded.safetensors"), loaded)
        save_tensors(os.path.join(out, "other_world_final.safetensors"), final)
    barrier()


def _hf_logits_diff(hf_dir: str, full: dict[str, torch.Tensor], batch: dict) -> float:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    mine = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    mine.load_state_dict(full)
    with torch.no_grad():
        a = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b = mine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return (a - b).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--zero_stages", default="3,2,0")
    p.add_argument("--param_dtype", default="fp32")
    p.add_argument("--extra_checks", type=int, default=1)
    p.add_argument("--adam_offload", type=int, default=0)
    p.add_argument("--resume_ckpt", default=None, help="a step-3 checkpoint of another world size to resume")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist = init_distributed(args.device)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model_dir).vocab_size
    batches = make_batches(args.steps, vocab)
    res: dict = {"world_size": dist.world_size, "stages": {}}
    if dist.rank == 0:
        shutil.rmtree(args.out, ignore_errors=True)
        os.makedirs(args.out)
    barrier()
    for i, stage in enumerate(int(s) for s in args.zero_stages.split(",")):
        b = new_backend(args.model_dir, stage, dist, args.steps, args.param_dtype, bool(args.adam_offload))
        losses, norms = train_steps(b, batches, dist)
        sleep = sleep_check(b, batches[0])
        sd = b.full_state_dict()
        if dist.rank == 0:
            param = next(b.model.parameters())
            res["stages"][str(stage)] = {"losses": losses, "grad_norms": norms, "sleep": sleep,
                                         "mesh": [list(b.mesh.mesh_dim_names), list(b.mesh.shape)],
                                         "param_mesh_dims": list(param.device_mesh.mesh_dim_names)}
            save_tensors(os.path.join(args.out, f"stage{stage}.safetensors"), sd)
        del b, sd
        if i == 0 and args.extra_checks:
            extra_checks(args.model_dir, args.out, stage, dist, args.steps, batches, res)
        if i == 0 and args.resume_ckpt:
            resume_from_other_world(args.model_dir, args.resume_ckpt, args.out, stage, dist, args.steps,
                                    batches, res)
    if dist.rank == 0:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
    barrier()
    if dist.has_process_group:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
