"""PPO-ptx: a policy step adds --ptx_coef x the SFT loss of pretraining batches (rlhfkit.data.ptx).

One optimizer step of the policy on a fixed experience batch, with and without a pretraining
source: the gradient difference must be ptx_coef x the gradient of the token-mean NLL of exactly
the pretraining rows that `PtxBatches` hands out for that step (computed here on a fresh copy of the
model), and the logged `ptx_loss` must be that NLL. The next optimizer step draws the next rows.
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.data.items import SFTItem
from rlhfkit.data.ptx import PtxBatches
from rlhfkit.losses.policy import PolicyLossConfig
from rlhfkit.models.forward import token_logprobs
from rlhfkit.roles.actor import ActorRole, UpdateConfig
from rlhfkit.types import ExperienceBatch

CPU = DistInfo(device="cpu")
COEF = 0.3


def new_backend(model_dir: str) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = OptimConfig(learning_rate=1e-3, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=0.0)
    return FSDP2Backend(model, BackendConfig(param_dtype="fp32"), optim, 5, CPU)


def pretrain_items(n: int = 7) -> list[SFTItem]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        ids = torch.randint(6, 90, (5 + i,), generator=g).tolist()
        out.append(SFTItem(ids, [0] + [1] * (len(ids) - 1)))  # pretrain mode: every predicted token
    return out


def experience() -> ExperienceBatch:
    ids = torch.randint(6, 90, (4, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * loss_mask
    return ExperienceBatch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask,
                           old_logprobs=torch.zeros(ids.shape), advantages=adv.float())


def grads_of_step(b: FSDP2Backend, role: ActorRole, batch: ExperienceBatch) -> tuple[dict, dict]:
    seen = []
    b.optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.append({n: p.grad.clone() for n, p in b.model.named_parameters()}))
    m = role._step(batch, 0.0)
    return seen[0], m


def role_for(b: FSDP2Backend, ptx: PtxBatches | None, coef: float) -> ActorRole:
    # 2 micro-batches of 2 rows per optimizer step: two pretraining micro-batches per step
    upd = UpdateConfig(train_batch_size=4, micro_train_batch_size=2, compute_entropy=False, ptx_coef=coef)
    return ActorRole(b, CPU, PolicyLossConfig(), upd, ptx=ptx)


def test_policy_step_adds_ptx_coef_times_the_sft_loss(tiny_model_dir):
    batch = experience()
    items = pretrain_items()
    base, _ = grads_of_step(b0 := new_backend(tiny_model_dir), role_for(b0, None, 0.0), batch)
    ptx = PtxBatches(items, micro_batch_size=2, pad_token_id=0, seed=3)
    with_ptx, m = grads_of_step(b1 := new_backend(tiny_model_dir), role_for(b1, ptx, COEF), batch)

    # by hand: the rows of global micro-batches 0 and 1 (optimizer step 0), token-mean NLL over both
    rows = [ptx.row(j) for j in ptx.indices(0) + ptx.indices(1)]
    model = new_backend(tiny_model_dir).model
    nll, count = 0.0, 0.0
    for r in rows:
        ids = torch.tensor([r.input_ids])
        lp = token_logprobs(model, ids, attention_mask=torch.ones_like(ids))
        mask = torch.tensor([r.loss_mask], dtype=torch.float32)
        nll = nll - (lp * mask).sum()
        count += float(mask.sum())
    sft = nll / count
    hand = torch.autograd.grad(sft, list(model.parameters()))
    assert m["ptx_loss"] == pytest.approx(sft.detach().item(), rel=1e-5)
    for (name, _), g in zip(model.named_parameters(), hand):
        torch.testing.assert_close(with_ptx[name] - base[name], COEF * g, atol=2e-6, rtol=1e-4, msg=name)
    assert max(float(g.abs().max()) for g in hand) > 1e-4

    # the next optimizer step takes the next pretraining rows
    assert b1.steps_done == 1
    seen = []
    real = ptx.batch
    ptx.batch = lambda g: (seen.append(g), real(g))[1]
    role_for(b1, ptx, COEF)._step(batch, 0.0)
    assert seen == [2, 3]


def test_stream_covers_every_item_once_per_epoch():
    items = pretrain_items(6)
    ranks = [PtxBatches(items, micro_batch_size=1, pad_token_id=0, rank=r, world_size=2, seed=1) for r in range(2)]
    epoch0 = [id(rk.row(j)) for g in range(3) for rk in ranks for j in rk.indices(g)]
    assert sorted(epoch0) == sorted(map(id, items))
    # the second epoch is another permutation of the same items
    stream0 = [id(ranks[0].row(j)) for j in range(6)]
    stream1 = [id(ranks[0].row(j)) for j in range(6, 12)]
    assert sorted(stream1) == sorted(map(id, items)) and stream1 != stream0
