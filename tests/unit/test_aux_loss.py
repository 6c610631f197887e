"""--aux_loss_coef on a tiny Mixtral (4 experts, top 2, built offline): the router balance loss is in
the loss and its gradient reaches the router.

For one optimizer step on one micro-batch, the router weight's gradient with coefficient c minus
the one with c = 0 must equal c x d(aux)/d(router), where aux is what the Hugging Face model itself
returns for that batch with `output_router_logits=True`; the logged `aux_loss` equals aux. Both the
offline loop (SFT here; DPO and the rest share it) and the PPO policy are checked. A dense model
prints one note that the flag has no effect.
"""

from __future__ import annotations

import logging

import pytest
import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config import notes
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.data.collate import pad_batch
from rlhfkit.data.items import SFTItem
from rlhfkit.losses.policy import PolicyLossConfig
from rlhfkit.roles.actor import ActorRole, UpdateConfig
from rlhfkit.trainers.offline import _train_step
from rlhfkit.trainers.sft_task import SFTTask
from rlhfkit.types import ExperienceBatch

CPU = DistInfo(device="cpu")
ROUTER = "model.layers.0.mlp.gate.weight"


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> str:
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_mixtral"))
    return make_tiny_model(path, TinyModelSpec(arch="mixtral", hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               intermediate_size=64, max_position_embeddings=128))


def new_backend(model_dir: str) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = OptimConfig(learning_rate=1e-3, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=0.0)
    return FSDP2Backend(model, BackendConfig(param_dtype="fp32"), optim, 5, CPU)


def router_grad_of_step(b: FSDP2Backend, run) -> tuple[torch.Tensor, dict]:
    """Run one step (`run()` -> metrics) and return the router gradient the optimizer stepped with."""
    seen = []
    router = dict(b.model.named_parameters())[ROUTER]
    b.optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(router.grad.clone()))
    metrics = run()
    return seen[0], metrics


def hand_aux(model_dir: str, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(aux, d aux / d router) from a fresh copy of the model, as transformers computes it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True, use_cache=False)
    (g,) = torch.autograd.grad(out.aux_loss, dict(model.named_parameters())[ROUTER])
    return float(out.aux_loss.detach()), g


def sft_items() -> list[SFTItem]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (9, 12, 7):
        ids = torch.randint(6, 90, (n,), generator=g).tolist()
        out.append(SFTItem(ids, [0, 0, 0] + [1] * (n - 3)))
    return out


def test_offline_loop_adds_the_router_loss(tiny_moe_dir):
    items = sft_items()
    task = SFTTask(pad_token_id=0)
    grads, metrics = {}, {}
    for coef in (0.0, 0.5):
        b = new_backend(tiny_moe_dir)
        grads[coef], metrics[coef] = router_grad_of_step(
            b, lambda: _train_step(task, b, [task.collate(items)], CPU, aux_loss_coef=coef))
    batch = pad_batch(items, 0)
    aux, d_aux = hand_aux(tiny_moe_dir, batch.input_ids, batch.attention_mask)
    assert "aux_loss" not in metrics[0.0]
    assert metrics[0.5]["aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert metrics[0.5]["loss"] == pytest.approx(metrics[0.0]["loss"], rel=1e-6)  # the task's own loss
    assert d_aux.abs().max() > 1e-6
    torch.testing.assert_close(grads[0.5] - grads[0.0], 0.5 * d_aux, atol=1e-6, rtol=1e-4)


def experience(input_ids: torch.Tensor) -> ExperienceBatch:
    mask = torch.ones_like(input_ids)
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    adv = torch.linspace(-1.0, 1.0, input_ids.shape[0])[:, None].expand_as(input_ids).contiguous() * loss_mask
    return ExperienceBatch(input_ids=input_ids, attention_mask=mask, loss_mask=loss_mask,
                           old_logprobs=torch.zeros(input_ids.shape), advantages=adv.float())


def test_policy_step_adds_the_router_loss(tiny_moe_dir):
    ids = torch.randint(6, 90, (4, 10), generator=torch.Generator().manual_seed(1))
    batch = experience(ids)
    grads, metrics = {}, {}
    for coef in (0.0, 2.0):
        b = new_backend(tiny_moe_dir)
        upd = UpdateConfig(train_batch_size=4, micro_train_batch_size=4, compute_entropy=False, aux_loss_coef=coef)
        role = ActorRole(b, CPU, PolicyLossConfig(), upd)
        grads[coef], metrics[coef] = router_grad_of_step(b, lambda: role._step(batch, 0.0))
    aux, d_aux = hand_aux(tiny_moe_dir, ids, batch.attention_mask)
    assert metrics[2.0]["aux_loss"] == pytest.approx(aux, rel=1e-5)
    torch.testing.assert_close(grads[2.0] - grads[0.0], 2.0 * d_aux, atol=1e-6, rtol=1e-4)


def test_dense_model_notes_once(tiny_model_dir, caplog, monkeypatch):
    monkeypatch.setattr(notes, "_NOTED", set())
    caplog.set_level(logging.INFO)  # the note is a log record (printed once a CLI has set up logging)
    b = new_backend(tiny_model_dir)
    task = SFTTask(pad_token_id=0)
    for _ in range(2):
        m = _train_step(task, b, [task.collate(sft_items())], CPU, aux_loss_coef=0.1)
    assert "aux_loss" not in m
    assert caplog.text.count("note: --aux_loss_coef has no effect") == 1, caplog.text
