"""Worker of test_ring_attention.py's HF case: a transformers model runs ring attention through an
attention hook, and its logits, loss and gradients on a ring of N equal one process's.

    torchrun --nproc_per_node N tests/distributed/ring_attention_hf_worker.py --out DIR

The hook is what wiring context parallelism into a model needs (not wired into rlhfkit yet):
`AttentionInterface.register("ring", fn)` where fn gets q [B, Hq, S_local, D] and k/v [B, Hkv, S_local, D]
(RoPE applied, K/V not repeated) and returns [B, S_local, Hq, D]; the mask builder for "ring" returns
None (the ring builds its own). Input ids and position ids are split with `split_for_ring` (so RoPE
sees global positions), labels are shifted on the full row *before* the split, and the loss is a sum
over local tokens divided by the global token count, so summing parameter gradients over the ring
gives the full gradient. Packed: one row of several sequences, position ids restarting at 0, and
cu_seqlens from the full row's position ids reach the hook through the model's kwargs.
Writes DIR/rank{r}.json: case -> max abs error of logits, loss and gradients.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from rlhfkit.parallel.ring_attention import (
    cu_seqlens_from_position_ids,
    gather_from_ring,
    ring_attention,
    split_for_ring,
)
from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model


def ring_attention_hook(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cu = kwargs.get("ring_cu_seqlens")
    if cu is None:
        out = ring_attention(query, key, value, dist.group.WORLD, scale=scaling, total_len=kwargs["ring_total_len"])
        return out.transpose(1, 2), None
    packed = [t.squeeze(0).transpose(0, 1) for t in (query, key, value)]  # [1, H, T, D] -> [T, H, D]
    return ring_attention(*packed, dist.group.WORLD, scale=scaling, cu_seqlens=cu).unsqueeze(0), None


def _shifted(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Next-token labels on the full rows; -100 at each sequence's last token (packed: before a 0)."""
    lab = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    nxt = torch.cat([pos[:, 1:], torch.zeros_like(pos[:, :1])], 1)
    return lab.masked_fill(nxt == 0, -100)


def run_case(model_dir, ids, pos, rank, world, packed):
    torch.manual_seed(0)
    labels = _shifted(ids, pos)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if packed:  # the reference attends each sequence on its own: one row per sequence
        cu = cu_seqlens_from_position_ids(pos).tolist()
        ref_logits, total = [], 0.0
        for a, b in itertools.pairwise(cu):
            lg = ref_model(ids[:, a:b]).logits
            ref_logits.append(lg)
            total = total + F.cross_entropy(lg[0], labels[0, a:b], ignore_index=-100, reduction="sum")
        ref_logits = torch.cat(ref_logits, 1)
    else:
        ref_logits = ref_model(ids).logits
        total = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    count = int((labels != -100).sum())
    ref_loss = total / count
    ref_loss.backward()

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="ring")
    loc_ids, loc_pos = split_for_ring(ids, rank, world, 1), split_for_ring(pos, rank, world, 1)
    loc_lab = split_for_ring(labels, rank, world, 1, pad_value=-100)
    extra = ({"ring_cu_seqlens": cu_seqlens_from_position_ids(pos)} if packed else {"ring_total_len": ids.shape[1]})
    logits = model(loc_ids, position_ids=loc_pos, **extra).logits
    local = F.cross_entropy(logits.flatten(0, 1), loc_lab.flatten(), ignore_index=-100, reduction="sum")
    (local / count).backward()
    loss = local.detach().clone()
    dist.all_reduce(loss)
    full = gather_from_ring(logits.detach(), dist.group.WORLD, dim=1, length=ids.shape[1])
    grad_err = 0.0
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grad_err = max(grad_err, float((g - ref_params[name].grad).abs().max()))
    return {"logits": float((full - ref_logits.detach()).abs().max()),
            "loss": abs(float(loss) / count - float(ref_loss)), "grads": grad_err}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from rlhfkit.parallel.rendezvous import destroy_at_exit

    destroy_at_exit()  # gloo's threads settle before interpreter teardown
    rank, world = dist.get_rank(), dist.get_world_size()
    AttentionInterface.register("ring", ring_attention_hook)
    AttentionMaskInterface.register("ring", lambda *a, **k: None)
    model_dir = os.path.join(args.out, "model")
    if rank == 0:
        make_tiny_model(model_dir, TinyModelSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2))
    dist.barrier()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(10, 60, (2, 13), generator=gen)
    res = {"padded": run_case(model_dir, ids, torch.arange(13).expand(2, 13), rank, world, packed=False)}
    lens = [5, 3, 7]
    packed_ids = torch.randint(10, 60, (1, sum(lens)), generator=gen)
    packed_pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    res["packed"] = run_case(model_dir, packed_ids, packed_pos, rank, world, packed=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
