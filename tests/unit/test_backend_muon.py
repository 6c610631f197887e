"""--optim muon: Muon steps the hidden layers' 2-D weights, AdamW the rest (rlhfkit.backend.muon).

The reference is written here from Muon's update rule, not from torch:
momentum B <- mu B + g, Nesterov direction u = g + mu B, five quintic Newton-Schulz iterations
X <- a X + (b A + c A^2) X with A = X X^T (X = u / ||u||_F, wide orientation), and
W <- W - lr sqrt(max(1, rows / cols)) X. torch runs the iterations in bf16, so the comparison
allows bf16 error; an AdamW step on the same matrix would be -lr g / |g| element-wise, far off.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.muon import MuonWithAdamW
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.models.forward import token_logprobs

CPU = DistInfo(device="cpu")
MU, MUON_LR, ADAM_LR = 0.95, 0.02, 1e-3
HIDDEN = "model.layers.0.self_attn.q_proj.weight"


def newton_schulz(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm()
    for _ in range(steps):
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return (x.T if tall else x).float()


def muon_backend(model_dir: str) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = OptimConfig(optim="muon", learning_rate=ADAM_LR, muon_lr=MUON_LR, muon_momentum=MU, l2=0.0,
                      max_norm=0.0, lr_scheduler="constant", lr_warmup_ratio=0.0)
    return FSDP2Backend(model, BackendConfig(param_dtype="fp32"), cfg, 10, CPU)


def sft_step(b: FSDP2Backend, seed: int) -> dict[str, torch.Tensor]:
    """One optimizer step on random tokens; returns the gradients the optimizer stepped with."""
    ids = torch.randint(6, 90, (8, 48), generator=torch.Generator().manual_seed(seed))  # full-rank gradients
    lp = token_logprobs(b.model, ids, attention_mask=torch.ones_like(ids))
    b.backward(-lp.sum() / lp.numel())
    grads = {n: p.grad.clone() for n, p in b.model.named_parameters() if p.grad is not None}
    b.optimizer_step()
    return grads


def test_groups_put_hidden_matrices_under_muon(tiny_model_dir):
    b = muon_backend(tiny_model_dir)
    assert isinstance(b.optimizer, MuonWithAdamW)
    names = {id(p): n for n, p in b.model.named_parameters()}
    muon = {names[id(p)] for g in b.optimizer.param_groups if g.get("muon") for p in g["params"]}
    adam = {names[id(p)] for g in b.optimizer.param_groups if not g.get("muon") for p in g["params"]}
    assert HIDDEN in muon and "model.layers.1.mlp.down_proj.weight" in muon
    assert all(n.endswith("proj.weight") for n in muon), muon
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= adam
    assert not muon & adam and len(muon) + len(adam) == len(list(b.model.parameters()))


def test_two_steps_equal_the_muon_update_by_hand(tiny_model_dir):
    b = muon_backend(tiny_model_dir)
    params = dict(b.model.named_parameters())
    w0 = params[HIDDEN].detach().clone()
    e0 = params["model.embed_tokens.weight"].detach().clone()
    g1 = sft_step(b, 1)
    w1 = params[HIDDEN].detach().clone()
    e1 = params["model.embed_tokens.weight"].detach().clone()
    g2 = sft_step(b, 2)
    w2 = params[HIDDEN].detach().clone()
    rows, cols = w0.shape
    scale = MUON_LR * max(1.0, rows / cols) ** 0.5

    buf = g1[HIDDEN]
    expect1 = w0 - scale * newton_schulz(g1[HIDDEN] + MU * buf)
    buf = MU * buf + g2[HIDDEN]
    expect2 = w1 - scale * newton_schulz(g2[HIDDEN] + MU * buf)
    step1, step2 = w1 - w0, w2 - w1
    # bf16 Newton-Schulz in torch: compare the steps with a tolerance of a few % of their size
    assert (step1 - (expect1 - w0)).abs().max() < 0.05 * step1.abs().max()
    assert (step2 - (expect2 - w1)).abs().max() < 0.05 * step2.abs().max()
    # an orthogonalised step: its singular values are of one size (near 1 x scale), the gradient's are not
    sv = torch.linalg.svdvals(step1 / scale)
    assert sv.max() < 1.5 and sv.max() / sv.min() < 5, sv
    gsv = torch.linalg.svdvals(g1[HIDDEN])
    assert gsv.max() / gsv.min() > 50
    # the embedding is AdamW's: first step = -lr * g / (|g| + eps)
    ge = g1["model.embed_tokens.weight"]
    e1_expect = e0 - ADAM_LR * ge / (ge.abs() + 1e-8)
    torch.testing.assert_close(e1, e1_expect, atol=1e-7, rtol=1e-5)


def test_checkpoint_restores_muon_and_adamw_state(tiny_model_dir, tmp_path):
    b = muon_backend(tiny_model_dir)
    sft_step(b, 1)
    b.save_checkpoint(str(tmp_path), "global_step1", {"step": 1}, 2)
    state = {n: {k: v.clone() for k, v in b.optimizer.state[p].items()} for n, p in b.model.named_parameters()}
    c = muon_backend(tiny_model_dir)
    assert c.load_checkpoint(str(tmp_path)) == {"step": 1}
    for n, p in c.model.named_parameters():
        for k, v in state[n].items():
            torch.testing.assert_close(c.optimizer.state[p][k], v, msg=f"{n} {k}")
    assert "momentum_buffer" in state[HIDDEN] and "exp_avg" in state["lm_head.weight"]
    # after the load the inner optimizers step the reloaded groups and state
    g = sft_step(c, 2)
    assert g and c.optimizer._muon.state is c.optimizer.state


def test_a_model_without_hidden_matrices_is_an_error():
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 4)

    cfg = OptimConfig(optim="muon")
    try:
        FSDP2Backend(Head(), BackendConfig(param_dtype="fp32"), cfg, 1, CPU)
    except ValueError as e:
        assert "--optim muon" in str(e)
    else:
        raise AssertionError("expected a ValueError naming --optim muon")
