"""torchrun worker of test_tensor_parallel.py: tensor-parallel losses and gradients against one process.

    torchrun --nproc_per_node W tp_worker.py --model DIR --tp T --out FILE [--ckpt DIR]

Every rank also builds the plain model (no mesh, no process group in its forward) and computes
the reference on the *global* batch itself, so one launch compares both. Cases:

    kernel  vocab-parallel log-probs / entropy of random logits vs the full-vocabulary kernel
            (values and gradients), and the same with a wrong shard offset (must differ)
    sft     SFTTask loss on this dp rank's rows; dp-summed loss and gathered gradients (padded, packed)
    dpo     DPOTask loss (policy and reference both tensor-parallel)
    rl      actor log-probs with entropy -> PPO policy loss with an entropy bonus
    rm      a reward / value model (score head replicated): squared error of the last-token rewards
    ckpt    (--ckpt DIR) one SFT step, then a DCP checkpoint, an HF export and the full state dict
            (torch.save) under DIR for the test to load in one process

Rank 0 writes JSON {case: {"loss", "ref_loss", "grad_diff", "grad_scale", ...}}.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel import init_distributed
from rlhfkit.parallel.mesh import ParallelDims, attach_mesh
from rlhfkit.parallel.sharding import full
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig
from rlhfkit.data.items import PreferenceItem, SFTItem
from rlhfkit.losses.policy import PolicyLossConfig, policy_loss
from rlhfkit.models import forward as forward_mod
from rlhfkit.models.forward import logprobs_from_logits, token_logprobs
from rlhfkit.models.loader import load_causal_lm
from rlhfkit.models.value import load_value_model, reward_at_last_token
from rlhfkit.models.vocab_parallel import vocab_parallel_logprobs
from rlhfkit.roles.actor import row_logprobs
from rlhfkit.trainers.dpo_task import DPOTask, FrozenModel
from rlhfkit.trainers.sft_task import SFTTask

ROWS, SEQ, PROMPT = 8, 12, 4


def items(vocab: int, seed: int) -> list[SFTItem]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ROWS):
        n = int(torch.randint(PROMPT + 2, SEQ + 1, (), generator=g))
        ids = torch.randint(6, vocab, (n,), generator=g).tolist()
        out.append(SFTItem(input_ids=ids, loss_mask=[0] * PROMPT + [1] * (n - PROMPT)))
    return out


def pairs(vocab: int) -> list[PreferenceItem]:
    a, b = items(vocab, 11), items(vocab, 12)
    return [PreferenceItem(x.input_ids, x.loss_mask, y.input_ids, y.loss_mask) for x, y in zip(a, b)]


class Plain:
    """The one-process reference behind the backend's `token_logprobs` (what row_logprobs calls)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def eval(self) -> None:
        self.model.eval()

    def token_logprobs(self, input_ids: torch.Tensor, **kw):
        return token_logprobs(self.model, input_ids, **kw)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(case: str, loss, ref_loss, model, ref_model, dist) -> dict:
    tot = dist.all_reduce_dp(torch.tensor(float(loss.detach()), dtype=torch.float64))
    g, r = grads_of(model), grads_of(ref_model)
    assert set(g) == set(r), (case, sorted(set(g) ^ set(r)))
    diff = max(float((g[k] - r[k]).abs().max()) for k in r)
    scale = max(float(v.abs().max()) for v in r.values())
    return {"loss": float(tot), "ref_loss": float(ref_loss), "grad_diff": diff, "grad_scale": scale}


def shard(seq: list, dist) -> list:
    per = len(seq) // dist.dp_size
    return seq[dist.dp_rank * per:(dist.dp_rank + 1) * per]


def kernel_case(dist) -> dict:
    """Random logits [2, 5, 8 * tp]: this rank's slice against the full kernel, and a wrong offset."""
    tp, rank, group = dist.mesh.tp_size, dist.mesh.tp_rank, dist.mesh.tp_group
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 8 * tp, generator=g) * 3
    ids = torch.randint(0, 8 * tp, (2, 5), generator=g)
    w_lp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    ref = logits.clone().requires_grad_(True)
    lp, ent = logprobs_from_logits(ref, ids, temperature=0.7, return_entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    out = {}
    for name, offset in (("ok", rank * 8), ("bad", rank * 8 + 1)):
        local = logits[..., rank * 8:(rank + 1) * 8].clone().requires_grad_(True)
        vlp, vent = vocab_parallel_logprobs(local, ids, offset, group, temperature=0.7, return_entropy=True,
                                            chunk_size=3)
        ((vlp * w_lp).sum() + (vent * w_ent).sum()).backward()
        vlp, vent = vlp.detach(), vent.detach()
        out[name] = {"lp": float((vlp - lp.detach()).abs().max()), "ent": float((vent - ent.detach()).abs().max()),
                     "grad": float((local.grad - ref.grad[..., rank * 8:(rank + 1) * 8]).abs().max())}
    return out


def backend_for(path: str, dist, dims, trainable: bool = True) -> FSDP2Backend:
    model = load_causal_lm(ModelConfig(pretrain=path), master_dtype="fp32")
    return FSDP2Backend(model, BackendConfig(param_dtype="fp32", zero_stage=2),
                        OptimConfig(learning_rate=1e-2, lr_warmup_ratio=0.0) if trainable else None, 10, dist, parallel=dims)


def check_sharded(backend: FSDP2Backend, tp: int) -> None:
    """The attention / MLP / head weights really are split over tp (a test of the test)."""
    from torch.distributed.tensor import DTensor, Shard

    m = backend.unwrap()
    for name, dim in (("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.0.mlp.down_proj.weight", 1),
                      ("lm_head.weight", 0), ("model.embed_tokens.weight", 0)):
        p = m.get_parameter(name)
        assert isinstance(p, DTensor), name
        placements = dict(zip(p.device_mesh.mesh_dim_names, p.placements))
        assert placements["tp"] == Shard(dim), (name, p.placements)
    if m.config.tie_word_embeddings:
        assert m.lm_head.weight is m.model.embed_tokens.weight


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    dist = init_distributed("cpu")
    dims = ParallelDims.from_flags(dist.world_size, 2, tensor_parallel_size=a.tp)
    dist = attach_mesh(dist, dims)
    res: dict = {"kernel": kernel_case(dist)}
    seen = {"calls": 0, "local_vocab": set()}  # the sharded path is taken: each rank holds V / tp logits
    vocab_parallel = forward_mod.vocab_parallel_logprobs

    def spy(local_logits, *args, **kw):
        seen["calls"] += 1
        seen["local_vocab"].add(local_logits.shape[-1])
        return vocab_parallel(local_logits, *args, **kw)

    forward_mod.vocab_parallel_logprobs = spy
    ref_model = load_causal_lm(ModelConfig(pretrain=a.model), master_dtype="fp32")
    vocab = ref_model.config.vocab_size

    # ---- SFT
    backend = backend_for(a.model, dist, dims)
    check_sharded(backend, a.tp)
    task = SFTTask(pad_token_id=0, dist=dist)
    data = items(vocab, 3)
    count = float(sum(sum(x.loss_mask) for x in data))
    loss, _ = task.loss(backend.model, task.collate(shard(data, dist)), count)
    backend.backward(loss)
    ref_loss, _ = task.loss(ref_model, task.collate(data), count)
    ref_loss.backward()
    res["sft"] = compare("sft", loss, ref_loss, backend.model, ref_model, dist)
    # packed rows (one row per micro-batch, positions restart per sample)
    backend.optimizer.zero_grad(set_to_none=True)
    ref_model.zero_grad(set_to_none=True)
    packed = SFTTask(pad_token_id=0, packing=True, dist=dist)
    loss, _ = packed.loss(backend.model, packed.collate(shard(data, dist)), count)
    backend.backward(loss)
    ref_loss, _ = packed.loss(ref_model, packed.collate(data), count)
    ref_loss.backward()
    res["sft_packed"] = compare("sft_packed", loss, ref_loss, backend.model, ref_model, dist)

    if a.ckpt:
        stats = backend.optimizer_step()
        ref_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref_model.parameters()
                                                               if p.grad is not None])))
        backend.save_checkpoint(os.path.join(a.ckpt, "dcp"), "step1", {"step": 1}, max_keep=2)
        backend.save_hf(os.path.join(a.ckpt, "hf"), dtype=torch.float32)
        sd = backend.full_state_dict()
        synced = dict(backend.named_full_params())  # what the weight sync sends engines
        if dist.rank == 0:
            assert sorted(synced) == sorted(n for n, _ in backend.model.named_parameters()), sorted(synced)
            assert all(torch.equal(synced[k], sd[k]) for k in synced), "weight sync != full state dict"
        if dist.rank == 0:
            torch.save(sd, os.path.join(a.ckpt, "full.pt"))
        loss2, _ = task.loss(backend.model, task.collate(shard(data, dist)), count)
        res["ckpt"] = {"loss_after_step": float(dist.all_reduce_dp(loss2.detach().double())),
                       "grad_norm": stats["grad_norm"], "ref_grad_norm": ref_norm}
    del backend
    ref_model.zero_grad(set_to_none=True)

    # ---- DPO: the policy and its reference both tensor-parallel
    policy = backend_for(a.model, dist, dims)
    ref = FrozenModel(backend_for(a.model, dist, dims, trainable=False))
    # the reference starts from the same weights: move the policy (both copies) so the loss is not log 2
    with torch.no_grad():
        for m in (policy.model, ref_model):
            for n, prm in m.named_parameters():
                if n.endswith(("q_proj.weight", "up_proj.weight")):
                    prm.mul_(1.5)
    ref_plain = load_causal_lm(ModelConfig(pretrain=a.model), master_dtype="fp32")
    dpo = DPOTask(pad_token_id=0, ref=ref, beta=0.5, dist=dist)
    dpo_ref = DPOTask(pad_token_id=0, ref=FrozenModel(Plain(ref_plain)), beta=0.5)
    data = pairs(vocab)
    loss, _ = dpo.loss(policy.model, dpo.collate(shard(data, dist)), float(len(data)))
    policy.backward(loss)
    ref_loss, _ = dpo_ref.loss(ref_model, dpo_ref.collate(data), float(len(data)))
    ref_loss.backward()
    res["dpo"] = compare("dpo", loss, ref_loss, policy.model, ref_model, dist)
    ref_model.zero_grad(set_to_none=True)
    policy.optimizer.zero_grad(set_to_none=True)

    # ---- RL: log-probs + entropy through the backend, PPO loss with an entropy bonus
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(PROMPT + 2, SEQ + 1, (ROWS,), generator=g)
    attn = (torch.arange(SEQ)[None, :] < lens[:, None]).long()
    ids = torch.randint(6, vocab, (ROWS, SEQ), generator=g) * attn
    mask = attn.clone()
    mask[:, :PROMPT] = 0
    old = -torch.rand(ROWS, SEQ, generator=g) * 5 * mask
    adv = torch.randn(ROWS, SEQ, generator=g) * mask
    cfg = PolicyLossConfig(entropy_coef=0.01)
    ntok = float(mask.sum())
    rows = shard(list(range(ROWS)), dist)
    from rlhfkit.types import ExperienceBatch

    def rl_loss(be, r):
        mb = ExperienceBatch(input_ids=ids[r], attention_mask=attn[r], loss_mask=mask[r])
        lp, ent = row_logprobs(be, mb, temperature=0.9, entropy=True, packed=False)
        loss, _ = policy_loss(lp, old[r], adv[r], mask[r], cfg, num_tokens=ntok, num_sequences=float(ROWS),
                              entropy=ent)
        return loss

    loss = rl_loss(policy, rows)
    policy.backward(loss)
    ref_loss = rl_loss(Plain(ref_model), list(range(ROWS)))
    ref_loss.backward()
    res["rl"] = compare("rl", loss, ref_loss, policy.model, ref_model, dist)
    del policy, ref

    # ---- reward / value model: tensor-parallel backbone, replicated score head
    def value_model():
        torch.manual_seed(1)  # the same fresh head on every rank and in the reference
        return load_value_model(a.model, init_value_head=True)

    critic = FSDP2Backend(value_model(), BackendConfig(param_dtype="fp32", zero_stage=2),
                          OptimConfig(learning_rate=1e-2), 10, dist, parallel=dims)
    ref_value = value_model()
    target = torch.randn(ROWS, generator=g)

    def rm_loss(forward, r):
        rewards = reward_at_last_token(forward(input_ids=ids[r], attention_mask=attn[r]), attn[r])
        return ((rewards - target[r]) ** 2).sum() / ROWS

    loss = rm_loss(critic.forward, rows)
    critic.backward(loss)
    ref_loss = rm_loss(ref_value, list(range(ROWS)))
    ref_loss.backward()
    res["rm"] = compare("rm", loss, ref_loss, critic.model, ref_value, dist)
    res["vocab_parallel"] = {"calls": seen["calls"], "local_vocab": sorted(seen["local_vocab"])}
    if dist.rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
