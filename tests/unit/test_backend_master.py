"""fp32 master weights beside a bf16 module (one process): the step equals a hand-written
reference, accumulation sums in fp32, checkpoints keep the fp32 masters and load across modes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.optim import param_groups
from rlhfkit.config.configs import BackendConfig, OptimConfig

CPU = DistInfo(device="cpu")
OPT = dict(learning_rate=1e-3, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=0.0, l2=0.1,
           adam_betas=(0.9, 0.95), adam_eps=1e-8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.lin(self.emb(x)))))


def loss_fn(model: nn.Module, x: torch.Tensor, denom: float) -> torch.Tensor:
    logits = model(x[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum") / denom


def master_backend(**cfg) -> FSDP2Backend:
    return FSDP2Backend(Net(), BackendConfig(param_dtype="bf16", **cfg), OptimConfig(**OPT), 10, CPU,
                        cpu_low_precision=True)


def data(n: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 11, (n, 6), generator=torch.Generator().manual_seed(seed))


def test_step_equals_reference_fp32_adamw_on_bf16_gradients():
    b = master_backend()
    assert b.master is not None and all(p.dtype == torch.bfloat16 for p in b.model.parameters())
    # reference: the same bf16 module, its bf16 gradients upcast, AdamW on an fp32 copy
    ref_model = Net().to(torch.bfloat16)
    fp32 = {n: p.detach().float().clone() for n, p in Net().named_parameters()}
    x = data()
    b.backward(loss_fn(b.model, x, 20.0))
    assert all(p.grad is None for p in b.model.parameters())  # moved into the fp32 masters
    loss_fn(ref_model, x, 20.0).backward()
    ref_params = {n: nn.Parameter(t) for n, t in fp32.items()}
    for n, p in ref_model.named_parameters():
        ref_params[n].grad = p.grad.float()
    groups = param_groups(ref_model, OPT["l2"])
    name_of = {id(p): n for n, p in ref_model.named_parameters()}
    ref_opt = torch.optim.AdamW([{**g, "params": [ref_params[name_of[id(p)]] for p in g["params"]]}
                                 for g in groups], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    ref_opt.step()
    b.optimizer_step()
    sd = b.full_state_dict()
    for n, p in ref_params.items():
        assert sd[n].dtype == torch.float32
        torch.testing.assert_close(sd[n], p.detach(), rtol=0, atol=1e-7)
        live = dict(b.model.named_parameters())[n]
        assert torch.equal(live, p.detach().to(torch.bfloat16))  # module = masters rounded
    # the update (lr 1e-3) is below bf16 resolution for most entries: only the master keeps it
    assert not torch.equal(sd["lin.weight"], sd["lin.weight"].to(torch.bfloat16).float())


def test_accumulation_sums_in_fp32_and_equals_one_big_batch():
    x = data(8)
    big, acc = master_backend(), master_backend()
    big.backward(loss_fn(big.model, x, 40.0))
    for i in range(4):
        acc.backward(loss_fn(acc.model, x[2 * i:2 * i + 2], 40.0), sync_grads=i == 3)
    for mb, ma in zip(big.master.masters, acc.master.masters):
        assert ma.grad.dtype == torch.float32
        torch.testing.assert_close(ma.grad, mb.grad, rtol=2e-2, atol=2e-3)  # bf16 forward rounding only
    big.optimizer_step()
    acc.optimizer_step()
    for mb, ma in zip(big.master.masters, acc.master.masters):
        torch.testing.assert_close(ma, mb, rtol=0, atol=3e-3)


def train(b: FSDP2Backend, steps: range) -> None:
    for s in steps:
        b.backward(loss_fn(b.model, data(seed=s), 20.0))
        b.optimizer_step()


def test_resume_from_checkpoint_equals_uninterrupted(tmp_path):
    full = master_backend()
    train(full, range(4))
    first = master_backend()
    train(first, range(2))
    first.save_checkpoint(str(tmp_path), "s2", {"step": 2}, max_keep=2)
    resumed = master_backend()
    assert resumed.load_checkpoint(str(tmp_path)) == {"step": 2}
    for a, b in zip(resumed.master.masters, first.master.masters):
        assert torch.equal(a, b)  # fp32 masters, not their bf16 rounding
    train(resumed, range(2, 4))
    for a, b in zip(resumed.master.masters, full.master.masters):
        assert torch.equal(a, b)
    for a, b in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_loads_into_an_fp32_backend_and_back(tmp_path):
    mw = master_backend()
    train(mw, range(2))
    mw.save_checkpoint(str(tmp_path / "a"), "s2", {}, max_keep=1)
    plain = FSDP2Backend(Net(), BackendConfig(param_dtype="fp32"), OptimConfig(**OPT), 10, CPU)
    plain.load_checkpoint(str(tmp_path / "a"))
    psd, msd = plain.full_state_dict(), mw.full_state_dict()
    assert all(torch.equal(psd[k], msd[k]) for k in msd)
    ps, ms = plain.optimizer_state_dict()["state"], mw.optimizer_state_dict()["state"]
    assert ps.keys() == ms.keys() and all(torch.equal(ps[k]["exp_avg_sq"], ms[k]["exp_avg_sq"]) for k in ms)
    plain.save_checkpoint(str(tmp_path / "b"), "s2", {}, max_keep=1)
    back = master_backend()
    back.load_checkpoint(str(tmp_path / "b"))
    for a, b in zip(back.master.masters, mw.master.masters):
        assert torch.equal(a, b)


def test_offload_keeps_masters_and_autocast_mode_is_selectable():
    b = master_backend()
    train(b, range(1))
    before = [m.clone() for m in b.master.masters]
    b.offload_states()  # no-op on CPU, must not break the optimizer's view of the masters
    b.reload_states()
    assert all(torch.equal(a, m) for a, m in zip(before, b.master.masters))
    assert b.optimizer.param_groups[0]["params"][0] is b.master.masters[0] or any(
        p is m for p in b.optimizer.param_groups[0]["params"] for m in b.master.masters)
    ac = master_backend(mixed_precision="autocast")
    assert ac.master is None and all(p.dtype == torch.float32 for p in ac.model.parameters())
    with pytest.raises(ValueError, match="--mixed_precision"):
        master_backend(mixed_precision="pure")
