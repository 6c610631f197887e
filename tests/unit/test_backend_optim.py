"""LR schedules at hand-computed steps; AdamW decay / no-decay groups; config errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rlhfkit.backend.optim import build_optimizer, build_scheduler, num_warmup_steps, param_groups
from rlhfkit.config.configs import OptimConfig


def lrs(name: str, total: int = 10, warmup_ratio: float = 0.2, min_ratio: float = 0.1,
        upto: int = 13) -> list[float]:
    """The learning rate in force at steps 0..upto-1 (lr = 1.0), read from a real optimizer."""
    p = nn.Parameter(torch.zeros(1))
    cfg = OptimConfig(learning_rate=1.0, lr_scheduler=name, lr_warmup_ratio=warmup_ratio,
                      min_lr_ratio=min_ratio)
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = build_scheduler(opt, cfg, total)
    out = []
    for _ in range(upto):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


# total 10, warm-up ceil(0.2 * 10) = 2 steps, progress p = (step - 2) / 8
C4 = 0.5 * (1 + math.cos(math.pi * 0.25))  # step 4: p = 1/4


def test_cosine_with_min_lr_by_hand():
    v = lrs("cosine_with_min_lr")
    assert v[0] == pytest.approx(0.0)
    assert v[1] == pytest.approx(0.5)
    assert v[2] == pytest.approx(1.0)
    assert v[4] == pytest.approx(0.1 + 0.9 * C4)  # 0.868198
    assert v[6] == pytest.approx(0.55)  # p = 1/2: 0.1 + 0.9 * 0.5
    assert v[10] == pytest.approx(0.1)  # the end of the schedule: the minimum


def test_cosine_linear_constant_by_hand():
    c = lrs("cosine")
    assert (c[1], c[2], c[4], c[6], c[10]) == pytest.approx((0.5, 1.0, C4, 0.5, 0.0))
    lin = lrs("linear")
    assert (lin[1], lin[2], lin[4], lin[6], lin[10]) == pytest.approx((0.5, 1.0, 0.75, 0.5, 0.0))
    assert lrs("constant") == pytest.approx([1.0] * 13)
    cw = lrs("constant_with_warmup")
    assert (cw[0], cw[1], cw[2], cw[9]) == pytest.approx((0.0, 0.5, 1.0, 1.0))


def test_warmup_rounds_up_and_zero_warmup():
    assert num_warmup_steps(OptimConfig(lr_warmup_ratio=0.03), 10) == 1  # ceil(0.3)
    assert num_warmup_steps(OptimConfig(lr_warmup_ratio=0.03), 100) == 3
    v = lrs("cosine_with_min_lr", warmup_ratio=0.0)
    assert v[0] == pytest.approx(1.0)
    assert v[5] == pytest.approx(0.1 + 0.9 * 0.5)


def test_scheduler_errors_name_the_flag():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="--lr_scheduler"):
        build_scheduler(opt, OptimConfig(lr_scheduler="cosine_restarts"), 10)
    with pytest.raises(ValueError, match="--lr_scheduler 'reduce_lr_on_plateau'"):  # needs a metric
        build_scheduler(opt, OptimConfig(lr_scheduler="reduce_lr_on_plateau"), 10)
    with pytest.raises(ValueError, match="--lr_warmup_ratio"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(lr_warmup_ratio=1.5))
    with pytest.raises(ValueError, match="--adam_betas"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(adam_betas=(0.9,)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4, bias=False)
        self.frozen.weight.requires_grad_(False)


def test_decay_groups_exclude_bias_and_norm_and_frozen():
    m = Block()
    groups = param_groups(m, weight_decay=0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decay == {"proj.weight"}
    assert no_decay == {"proj.bias", "ln.weight", "ln.bias"}


def test_decay_groups_on_hf_model(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    opt = build_optimizer(m, OptimConfig(l2=0.05))
    names = {id(p): n for n, p in m.named_parameters()}
    no_decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    expected = {n for n, _ in m.named_parameters() if n.endswith(".bias") or "norm" in n}
    assert no_decay == expected
    assert any(n.endswith("q_proj.bias") for n in no_decay)  # qwen2 has attention biases
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(m.parameters()))


def test_adamw_decay_applies_only_to_decay_group():
    """Zero gradients: AdamW's update is 0, so decayed weights shrink by exactly (1 - lr * wd)."""
    torch.manual_seed(0)
    m = Block()
    opt = build_optimizer(m, OptimConfig(learning_rate=0.1, l2=0.5, adam_eps=1e-8))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for p in m.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(m.named_parameters())
    torch.testing.assert_close(after["proj.weight"], before["proj.weight"] * (1 - 0.1 * 0.5))
    torch.testing.assert_close(after["proj.bias"], before["proj.bias"])
    torch.testing.assert_close(after["ln.weight"], before["ln.weight"])
    torch.testing.assert_close(after["frozen.weight"], before["frozen.weight"])


def test_schedule_state_loads_weights_only_and_resumes(tmp_path):
    """A resumed scheduler (state saved, loaded with weights_only=True) gives the uninterrupted rates."""
    whole = lrs("cosine_with_min_lr", upto=10)
    p = nn.Parameter(torch.zeros(1))
    cfg = OptimConfig(learning_rate=1.0, lr_scheduler="cosine_with_min_lr", lr_warmup_ratio=0.2, min_lr_ratio=0.1)
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = build_scheduler(opt, cfg, 10)
    for _ in range(4):
        opt.step()
        sched.step()
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    opt2 = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_scheduler(opt2, cfg, 10)
    sched2.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert sched2.get_last_lr()[0] == pytest.approx(whole[4])
