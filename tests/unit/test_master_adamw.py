"""The fused master-weight AdamW step (rlhfkit/backend/master_adamw.py) and the kept bf16 gradients
of MasterWeights (rlhfkit/backend/master.py).

* `fused_step_eager` (the kernel's update written in PyTorch) equals torch's AdamW over three steps
  with weight decay, a clipping factor and a skipped (found_inf) step;
* kept gradients: two micro-batches sum to the very same fp32 gradients as without keeping, one
  micro-batch keeps the bf16 gradient, whose norm equals the upcast one's;
* where the kernel does not apply (CPU here) `MasterAdamW` is torch's AdamW bit for bit, kept
  gradients upcast first;
* the Triton kernel equals the reference: on CUDA, and on CPU under TRITON_INTERPRET=1 (with
  Triton installed), including bf16 copies written, a tensor without gradient left alone, a
  skipped step and the non-finite flag.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from rlhfkit.backend import master_adamw
from rlhfkit.backend.master import MasterWeights
from rlhfkit.backend.master_adamw import MasterAdamW, fused_step_eager
from rlhfkit.backend.optim import param_groups
from rlhfkit.parallel.sharding import global_grad_norm

BETAS = (0.9, 0.95)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(13, 16)
        self.lin = nn.Linear(16, 600)  # 9600 weights: two whole kernel blocks and a tail
        self.out = nn.Linear(600, 16)
        self.unused = nn.Linear(16, 3)  # never gets a gradient
        self.head = nn.Linear(16, 13, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.out(torch.tanh(self.lin(self.emb(x)))))


def loss(model: nn.Module, seed: int) -> torch.Tensor:
    x = torch.randint(0, 13, (4, 7), generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).device)
    return model(x[:, :-1]).float().log_softmax(-1).gather(-1, x[:, 1:, None]).mean() * -(3 + seed)


def setup(device: str = "cpu", keep: bool = False, opt_cls: type = MasterAdamW):
    model = Net().to(device)
    master = MasterWeights(model, torch.bfloat16)
    master.keep_low_grads = keep
    groups = master.param_groups(param_groups(model, 0.1))
    if opt_cls is MasterAdamW:
        opt = MasterAdamW(groups, master, lr=1e-2, betas=BETAS, eps=1e-8)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=BETAS, eps=1e-8)
    return model, master, opt


def test_eager_update_equals_torch_adamw_with_clip_and_skip():
    torch.manual_seed(0)
    w0 = torch.randn(300)
    ref = nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([ref], lr=3e-2, betas=BETAS, eps=1e-8, weight_decay=0.1, foreach=False)
    w, m, v, low, step = w0.clone(), torch.zeros(300), torch.zeros(300), torch.zeros(300, dtype=torch.bfloat16), \
        torch.zeros(())
    for k in range(4):
        g = torch.randn(300, generator=torch.Generator().manual_seed(k)) * (k + 1)
        scale = torch.tensor(1.0 + k)
        skip = torch.tensor(1.0 if k == 2 else 0.0)
        fused_step_eager(g, w, m, v, low, step, 3e-2, BETAS, 1e-8, 0.1, grad_scale=scale, found_inf=skip)
        if k != 2:
            ref.grad = g / scale
            opt.step()
    st = opt.state[ref]
    assert float(step) == float(st["step"]) == 3.0
    torch.testing.assert_close(w, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, st["exp_avg"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    assert torch.equal(low, w.to(torch.bfloat16))


def test_kept_gradients_sum_like_fp32_and_give_the_same_norm():
    kept, plain = setup(keep=True), setup(keep=False)
    for model, master, _ in (kept, plain):
        loss(model, 0).backward()
    k_master, p_master = kept[1], plain[1]
    assert all(m.grad is None for m in k_master.masters)
    low = k_master.current_grads()
    assert low and all(g.dtype == torch.bfloat16 for g in low.values())
    ref = global_grad_norm(p_master.masters)
    assert float(k_master.grad_norm()) == pytest.approx(float(ref), rel=1e-6)
    for model, _, _ in (kept, plain):  # a second micro-batch: the first upcast, the second added in fp32
        loss(model, 1).backward()
    assert not k_master.has_low_grads()
    for a, b in zip(k_master.masters, p_master.masters):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)


def test_without_the_kernel_the_step_is_torch_adamw_bit_for_bit():
    model, master, opt = setup(keep=True)
    r_model, r_master, r_opt = setup(opt_cls=torch.optim.AdamW)
    assert not opt.kernel_usable()  # CPU tensors
    for k in range(3):
        for mm, o in ((model, opt), (r_model, r_opt)):
            loss(mm, k).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        assert not opt.wrote_module and opt.weights_bad is None
    for a, b in zip(master.masters, r_master.masters):
        assert torch.equal(a, b)
        assert opt.state[a].keys() == r_opt.state[b].keys()  # none for the unused layer
        for key in opt.state[a]:
            assert torch.equal(opt.state[a][key], r_opt.state[b][key])


def kernel_devices() -> list[str]:
    out = []
    if torch.cuda.is_available() and master_adamw.triton is not None:
        out.append("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1" and master_adamw.triton is not None:
        out.append("cpu")
    return out


@pytest.mark.skipif(not kernel_devices(), reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", kernel_devices())
def test_kernel_equals_the_eager_update(device, monkeypatch):
    model, master, opt = setup(device, keep=True)
    monkeypatch.setattr(MasterAdamW, "kernel_usable", lambda self: True)
    ref = {id(m): (m.detach().clone(), torch.zeros_like(m), torch.zeros_like(m), torch.zeros((), device=device))
           for m in master.masters}
    unused = master.master_of(model.unused.weight)
    for k in range(4):
        loss(model, k).backward()
        if k == 3:  # accumulation: fp32 gradients in the same step table as nothing kept
            loss(model, 7).backward()
        grads = {i: g.clone() for i, g in master.current_grads().items()}
        assert id(unused) not in grads
        scale = torch.tensor(1.5 + k, device=device)
        skip = torch.tensor(1.0 if k == 1 else 0.0, device=device)
        opt.found_inf, opt.grad_scale = skip, scale
        opt.step()
        del opt.found_inf, opt.grad_scale
        opt.zero_grad(set_to_none=True)
        assert opt.wrote_module and int(opt.weights_bad) == 0
        for group in opt.param_groups:
            for m in group["params"]:
                if id(m) in grads:
                    w, mm, v, step = ref[id(m)]
                    fused_step_eager(grads[id(m)], w, mm, v, torch.empty_like(w, dtype=torch.bfloat16), step,
                                     group["lr"], BETAS, 1e-8, group["weight_decay"], scale, skip)
    for m in master.masters:
        w, mm, v, step = ref[id(m)]
        torch.testing.assert_close(m, w, rtol=2e-6, atol=1e-7)
        low = master.low_param_of(m).detach()
        if device == "cuda":
            assert torch.equal(low, m.to(torch.bfloat16))
        else:  # Triton's interpreter rounds fp32 -> bf16 toward zero: within one bf16 step
            torch.testing.assert_close(low.float(), m, rtol=2 ** -7, atol=0)
        if m is unused or m is master.master_of(model.unused.bias):
            assert not opt.state[m] and float(step) == 0.0
            continue
        st = opt.state[m]
        assert float(st["step"]) == float(step) == 3.0
        torch.testing.assert_close(st["exp_avg"], mm, rtol=2e-6, atol=1e-8)
        torch.testing.assert_close(st["exp_avg_sq"], v, rtol=2e-6, atol=1e-9)
    # a weight made infinite: the flag of the next step says so
    with torch.no_grad():
        master.master_of(model.lin.weight)[0, 0] = float("inf")
    loss(model, 9).backward()
    opt.step()
    assert int(opt.weights_bad) == 1
