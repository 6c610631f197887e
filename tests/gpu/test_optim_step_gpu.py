"""The one-GPU optimizer step launched before its skip decision (rlhfkit/backend/optim_step.py) on CUDA:
bf16 module, fp32 master weights, fused AdamW.

* three steps with the masked path equal three steps with the decision taken first (weights, moments,
  step counts, grad norms), with gradient norms above --max_norm so that the folded clipping counts;
* a step with a non-finite loss launches the update, which the fused kernel masks: weights, moments
  and step counts unchanged, `skipped` 1; the next finite step goes on.

    pytest -q tests/gpu/test_optim_step_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make():
    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.parallel.dist import DistInfo
    from rlhfkit.config.configs import BackendConfig, OptimConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.GELU(), nn.Linear(256, 8, bias=False))
    optim = OptimConfig(learning_rate=1e-2, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=0.5,
                        max_nonfinite_steps=3)
    return FSDP2Backend(model, BackendConfig(param_dtype="bf16", device="cuda"), optim, 10, DistInfo(device="cuda"))


def step(b, k: int, extra: float = 0.0) -> dict:
    x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(k)).bfloat16()
    loss = b.model(x).float().pow(2).mean() * (3.0 + k) + extra
    b.backward(loss)
    return b.optimizer_step()


def state(b) -> dict:
    out = {f"m{i}": m.detach().clone() for i, m in enumerate(b.master.masters)}
    for i, m in enumerate(b.master.masters):
        for k, v in b.optimizer.state[m].items():
            out[f"{k}{i}"] = v.detach().clone()
    return out


def test_masked_step_equals_the_decided_step(monkeypatch):
    from rlhfkit.backend import optim_step

    fast = make()
    assert optim_step.can_mask_step(fast.optimizer, torch.zeros((), device="cuda"), False, False)
    got = [step(fast, k)["grad_norm"] for k in range(3)]
    monkeypatch.setattr(optim_step, "can_mask_step", lambda *a: False)
    plain = make()
    ref = [step(plain, k)["grad_norm"] for k in range(3)]
    assert min(ref) > 0.5  # every step clipped
    assert got == pytest.approx(ref, rel=1e-5)
    a, r = state(fast), state(plain)
    for k in r:
        torch.testing.assert_close(a[k], r[k], rtol=1e-5, atol=1e-7, msg=k)


def test_masked_step_skips_a_non_finite_step_on_the_device():
    b = make()
    step(b, 0)
    before = state(b)
    out = step(b, 1, extra=float("nan"))
    assert out["skipped"] == 1.0 and out["nonfinite_skipped"] == 1.0
    after = state(b)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    assert step(b, 2)["skipped"] == 0.0
    assert not torch.equal(state(b)["m0"], before["m0"])


def test_checkpoint_round_trip_with_the_master_kernel(tmp_path):
    """Resumed = uninterrupted with the one-pass master-weight AdamW (master_adamw.py): the state dict is
    torch AdamW's, and a step count loaded onto the host is moved to the device before the kernel reads it."""
    from rlhfkit.backend import master_adamw

    a = make()
    assert master_adamw.USE_KERNEL and a.master.keep_low_grads  # the kernel path is the one under test
    for k in range(2):
        step(a, k)
    root = str(tmp_path / "ckpt")
    a.save_checkpoint(root, "step2", {"step": 2}, max_keep=1)
    for k in range(2, 4):
        step(a, k)
    want = state(a)
    b = make()
    assert b.load_checkpoint(root) == {"step": 2}
    for k in range(2, 4):
        step(b, k)
    got = state(b)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # and the bf16 module equals the masters rounded, as after every step
    for p, m in zip(b.master.params, b.master.masters):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))
