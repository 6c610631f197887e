"""Memory-lean AdamW (rlhfkit/backend/lean_adamw.py): 8-bit blockwise moments (--optim adamw_8bit) and
bf16 weights without fp32 masters (--master_weights bf16_stochastic | bf16_kahan)."""

from __future__ import annotations

import functools

import pytest
import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.backend.lean_adamw import (FP8_MAX, LeanAdamW, dequantize_blockwise, kahan_add_bf16,
                                        quantize_blockwise, round_stochastic_bf16, state_bytes_per_param)
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.parallel.dist import DistInfo

KW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


# ----------------------------------------------------------------------------- 8-bit codes


def test_blockwise_code_error_bound_per_element():
    """Every value within 2^-4 of itself (3-bit mantissa, round to nearest) or, below the code's normal
    range, within half a subnormal step (2^-10 / 448 of its block's absmax); the block's max exact."""
    g = torch.Generator().manual_seed(0)
    # magnitudes spread over 10 decades, random signs, a row length that leaves a partial block
    x = torch.randn(64, 300, generator=g) * torch.logspace(-10, 0, 300)[torch.randperm(300, generator=g)]
    codes, absmax = quantize_blockwise(x, 256)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and absmax.shape == (64, 2)
    y = dequantize_blockwise(codes, absmax, 256)
    scale = torch.cat([absmax[:, :1].expand(64, 256), absmax[:, 1:].expand(64, 44)], 1)
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * scale / FP8_MAX + 1e-6 * x.abs()
    assert bool(((y - x).abs() <= bound).all())
    # the bound is tight: some value uses most of its relative 2^-4 allowance
    big = x.abs() > scale * 2.0 ** -6 / FP8_MAX
    assert float(((y - x).abs() / x.abs())[big].max()) > 0.05
    # each block's largest magnitude is kept (to fp32 rounding of the scale)
    flat = x.abs()
    for b, sl in enumerate((slice(0, 256), slice(256, 300))):
        i = flat[:, sl].argmax(1, keepdim=True)
        torch.testing.assert_close(y[:, sl].gather(1, i), x[:, sl].gather(1, i), rtol=1e-6, atol=0)
    # a block of zeros stays zeros; dynamic range: 1e-5 of the max is not flushed to 0
    z, a = quantize_blockwise(torch.zeros(2, 256))
    assert torch.equal(dequantize_blockwise(z, a), torch.zeros(2, 256))
    t = torch.tensor([[1.0, 1e-5] + [0.0] * 254])
    assert float(dequantize_blockwise(*quantize_blockwise(t))[0, 1]) > 0.5e-5


# ----------------------------------------------------------------------------- bf16 rounding


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    g = torch.Generator().manual_seed(1)
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    for frac in (0.1, 0.3, 0.5, 0.9):
        x = torch.full((200_000,), 1.0 + frac * ulp)
        r = round_stochastic_bf16(x, g).float()
        assert set(r.unique().tolist()) <= {1.0, 1.0 + ulp}
        # mean within 5 standard errors of x: ulp sqrt(p (1 - p)) / sqrt(n)
        se = ulp * (frac * (1 - frac)) ** 0.5 / len(x) ** 0.5
        assert abs(float(r.double().mean()) - float(x[0])) < 5 * se
    neg = round_stochastic_bf16(torch.full((200_000,), -(1.0 + 0.25 * ulp)), g).double().mean()
    assert abs(float(neg) + 1.0 + 0.25 * ulp) < 5 * ulp * (0.25 * 0.75 / 200_000) ** 0.5
    # round to nearest would be biased: 1 + 0.3 ulp always becomes 1
    assert float(torch.full((10,), 1.0 + 0.3 * ulp).to(torch.bfloat16).float().mean()) == 1.0
    # exact bf16 values are kept
    e = torch.tensor([1.0, -3.5, 0.0, 2.0 ** -20])
    assert torch.equal(round_stochastic_bf16(e, g).float(), e)


def test_kahan_summation_keeps_updates_below_half_a_bf16_step():
    w = torch.ones(4, dtype=torch.bfloat16)
    comp = torch.zeros(4, dtype=torch.bfloat16)
    plain = torch.ones(4, dtype=torch.bfloat16)
    delta = torch.full((4,), 1e-3)  # an eighth of bf16's spacing at 1
    for _ in range(1000):
        w, comp = kahan_add_bf16(w, comp, delta)
        plain = (plain.float() + delta).to(torch.bfloat16)
    assert torch.equal(plain.float(), torch.ones(4))  # rounded to nearest, nothing moves
    # the compensation's own bf16 rounding leaves a third of a bf16 step at 2 (2^-6) at most
    torch.testing.assert_close(w.float() + comp.float(), torch.full((4,), 2.0), rtol=0, atol=5e-3)
    assert float(w[0]) == 2.0


# ----------------------------------------------------------------------------- the update against torch's AdamW


def _steps(eight_bit: bool, weights: str, steps: int = 5, grad_scale: float = 1e-2):
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(128, 512, generator=g).bfloat16().float()
    grads = [torch.randn(128, 512, generator=g) * grad_scale for _ in range(steps)]
    ref_p = torch.nn.Parameter(w0.clone())
    ref = torch.optim.AdamW([ref_p], **KW)
    p = torch.nn.Parameter(w0.clone().to(torch.float32 if weights == "fp32" else torch.bfloat16))
    opt = LeanAdamW([p], eight_bit=eight_bit, weights=weights, **KW)
    for gr in grads:
        ref_p.grad, p.grad = gr.clone(), gr.to(p.dtype)
        ref.step()
        opt.step()
    return w0, ref_p.detach(), ref.state[ref_p], p.detach(), opt.state[p]


def test_fp32_weights_and_moments_equal_torch_adamw():
    _, ref, _, w, st = _steps(False, "fp32")
    torch.testing.assert_close(w, ref, rtol=0, atol=1e-6)
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}


def test_8bit_moments_follow_torch_adamw_within_a_few_percent():
    """After 5 steps (the norm of the difference over the norm): m within 6% of torch's, v within 12% (the
    code keeps sqrt(v) to 2^-4 a value), the weights' displacement within 3%; per element the
    displacement within half of the largest possible one (lr a step)."""
    w0, ref, ref_st, w, st = _steps(True, "fp32")
    assert st["exp_avg_code"].dtype == torch.uint8 and st["exp_avg_absmax"].shape == (128, 2)
    m = dequantize_blockwise(st["exp_avg_code"], st["exp_avg_absmax"])
    v = dequantize_blockwise(st["exp_avg_sq_sqrt_code"], st["exp_avg_sq_sqrt_absmax"]) ** 2
    assert float((m - ref_st["exp_avg"]).norm() / ref_st["exp_avg"].norm()) < 0.06
    assert float((v - ref_st["exp_avg_sq"]).norm() / ref_st["exp_avg_sq"].norm()) < 0.12
    d, d_ref = w - w0, ref - w0
    assert float((d - d_ref).norm() / d_ref.norm()) < 0.03
    assert float((d - d_ref).abs().max()) < 0.5 * 5 * KW["lr"]


def test_small_tensors_keep_fp32_moments():
    p = torch.nn.Parameter(torch.zeros(64, 32))  # 2048 < 4096 values
    b = torch.nn.Parameter(torch.zeros(8192))  # 1-D
    opt = LeanAdamW([p, b], eight_bit=True, **KW)
    p.grad, b.grad = torch.ones_like(p), torch.ones_like(b)
    opt.step()
    assert "exp_avg" in opt.state[p] and "exp_avg" in opt.state[b]


def test_bf16_kahan_tracks_fp32_adamw_to_16_bits():
    """bf16 weight + compensation within 2^-15 relative of torch's fp32 AdamW; the weight alone within one
    bf16 rounding (2^-8 relative); both up to the compensation's own rounding (2^-9 lr a step)."""
    _, ref, _, w, st = _steps(False, "bf16_kahan")
    assert w.dtype == torch.bfloat16 and st["kahan_comp"].dtype == torch.bfloat16
    full = w.float() + st["kahan_comp"].float()
    # the compensation's own bf16 rounding: 2^-9 of it (at most about one update, lr) per step
    assert bool(((full - ref).abs() <= 2.0 ** -15 * ref.abs() + 5 * 2.0 ** -9 * KW["lr"]).all())
    assert bool(((w.float() - ref).abs() <= 2.0 ** -8 * ref.abs() + 5 * 2.0 ** -9 * KW["lr"]).all())
    # without the compensation the 5 steps (each below half a bf16 step for most weights) would be lost
    assert float((w.float() + st["kahan_comp"].float() - w.float()).abs().max()) > 0


def test_bf16_stochastic_moves_weights_by_updates_far_below_a_bf16_step():
    """Constant gradients, lr 1e-5 on weights near 1 (bf16 spacing 2^-7): 50 updates of ~1e-5 each; round to
    nearest would never move, stochastic rounding moves the mean by the fp32 amount (within 5%)."""
    w0 = torch.ones(256, 256)
    p = torch.nn.Parameter(w0.clone().bfloat16())
    ref_p = torch.nn.Parameter(w0.clone())
    kw = {**KW, "lr": 1e-5, "weight_decay": 0.0}
    opt, ref = LeanAdamW([p], weights="bf16_stochastic", **kw), torch.optim.AdamW([ref_p], **kw)
    for _ in range(50):
        p.grad, ref_p.grad = torch.ones_like(p), torch.ones_like(ref_p)
        opt.step()
        ref.step()
    moved_ref = float((ref_p.detach() - w0).mean())
    moved = float((p.detach().float() - w0).double().mean())
    assert moved_ref == pytest.approx(-50e-5, rel=2e-2)
    assert moved == pytest.approx(moved_ref, rel=0.05)


def test_bf16_modes_refuse_fp32_weights_and_fp32_refuses_bf16():
    with pytest.raises(ValueError, match="bf16_stochastic"):
        LeanAdamW([torch.nn.Parameter(torch.zeros(3))], weights="bf16_stochastic")
    with pytest.raises(ValueError, match="fp32"):
        LeanAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], weights="fp32")


def test_bytes_per_param():
    assert state_bytes_per_param("adam", "fp32") == 16
    assert state_bytes_per_param("adamw_8bit", "fp32") == pytest.approx(10.03125)
    assert state_bytes_per_param("adamw_8bit", "bf16_stochastic") == pytest.approx(6.03125)
    assert state_bytes_per_param("adamw_8bit", "bf16_kahan") == pytest.approx(8.03125)
    # the real states of a 4096 x 256 tensor: 2 bytes of codes + 2 x 4 / 256 of maxima a value
    p = torch.nn.Parameter(torch.zeros(4096, 256, dtype=torch.bfloat16))
    opt = LeanAdamW([p], eight_bit=True, weights="bf16_kahan", **KW)
    p.grad = torch.ones_like(p)
    opt.step()
    got = sum(t.numel() * t.element_size() for t in opt.state[p].values() if t.ndim) / p.numel()
    assert got == pytest.approx(2 + 8 / 256 + 2)


# ----------------------------------------------------------------------------- through the backend


def _backend(model_dir: str, optim: str, master_weights: str, lr: float = 3e-3, steps: int = 50) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = OptimConfig(learning_rate=lr, l2=0.01, lr_warmup_ratio=0.0, lr_scheduler="constant", optim=optim,
                      master_weights=master_weights, max_norm=1.0)
    return FSDP2Backend(model, BackendConfig(param_dtype="bf16"), cfg, steps, DistInfo(device="cpu"),
                        cpu_low_precision=True)


def _train(b: FSDP2Backend, steps: int, start: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(6, b.model.config.vocab_size, (4, 16), generator=g) for _ in range(4)]
    losses = []
    for i in range(start, start + steps):
        ids = data[i % 4]
        logits = b.model(input_ids=ids).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        b.backward(loss)
        b.optimizer_step()
        losses.append(loss.item())
    return losses


@functools.lru_cache(maxsize=None)
def _reference_losses(model_dir: str, lr: float = 3e-3) -> tuple[float, ...]:
    return tuple(_train(_backend(model_dir, "adam", "fp32", lr=lr), 50))


LOSS_TOL = 0.08  # max |loss - fp32 AdamW's loss| over 50 SFT steps (the loss falls from 4.65 to about 0.6)


@pytest.mark.parametrize("optim,master_weights", [("adamw_8bit", "fp32"), ("adam", "bf16_stochastic"),
                                                  ("adam", "bf16_kahan"), ("adamw_8bit", "bf16_stochastic")])
def test_learning_matches_fp32_adamw(tiny_model_dir, optim, master_weights):
    """SFT of the tiny model (bf16 compute, 4 fixed batches, lr 3e-3, 50 steps): every step's loss within
    LOSS_TOL of fp32-master AdamW's; the weights are bf16 under the bf16 modes (no masters)."""
    ref = _reference_losses(tiny_model_dir)
    b = _backend(tiny_model_dir, optim, master_weights)
    assert b.master is None if master_weights != "fp32" else b.master is not None
    if master_weights != "fp32":
        assert all(p.dtype == torch.bfloat16 for p in b.model.parameters())
    losses = _train(b, 50)
    assert ref[-1] < ref[0] - 3.0  # it learns
    assert max(abs(a - r) for a, r in zip(losses, ref)) < LOSS_TOL


def test_learning_tolerance_tells_a_different_learning_rate_apart(tiny_model_dir):
    """Control: AdamW at 0.6x the learning rate misses LOSS_TOL, so the comparison above can fail."""
    ref = _reference_losses(tiny_model_dir)
    other = _train(_backend(tiny_model_dir, "adam", "fp32", lr=1.8e-3), 50)
    assert max(abs(a - r) for a, r in zip(other, ref)) > LOSS_TOL


@pytest.mark.parametrize("master_weights", ["bf16_stochastic", "bf16_kahan"])
def test_resume_equals_uninterrupted(tiny_model_dir, tmp_path, master_weights):
    root = str(tmp_path / "ckpt")
    a = _backend(tiny_model_dir, "adamw_8bit", master_weights, steps=6)
    _train(a, 3)
    a.save_checkpoint(root, "step3", {"step": 3}, max_keep=2)
    tail = _train(a, 3, start=3)
    want = {k: v.clone() for k, v in a.model.state_dict().items()}

    b = _backend(tiny_model_dir, "adamw_8bit", master_weights, steps=6)
    b.load_checkpoint(root)
    st = next(iter(b.optimizer.state.values()))
    assert "kahan_comp" in st if master_weights == "bf16_kahan" else "sr_key" in st
    assert _train(b, 3, start=3) == tail
    got = b.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)

    # control: the same 3 steps from a fresh optimizer state end elsewhere
    c = _backend(tiny_model_dir, "adamw_8bit", master_weights, steps=6)
    c.load_checkpoint(root)
    c.optimizer.state.clear()
    _train(c, 3, start=3)
    assert not all(torch.equal(want[k], c.model.state_dict()[k]) for k in want)


def test_bad_combinations_name_the_flag(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="--param_dtype bf16"):
        FSDP2Backend(model, BackendConfig(param_dtype="fp32"), OptimConfig(master_weights="bf16_kahan"), 5,
                     DistInfo(device="cpu"))
    with pytest.raises(ValueError, match="--optim adam or adamw_8bit"):
        FSDP2Backend(model, BackendConfig(param_dtype="bf16"), OptimConfig(optim="muon", master_weights="bf16_kahan"),
                     5, DistInfo(device="cpu"))
