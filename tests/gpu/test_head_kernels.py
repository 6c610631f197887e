"""The fused log-prob head's Triton row kernel (rlhfkit/models/head_kernels.py) on a CUDA GPU.

* the kernel against `row_stats_eager` (the PyTorch reference) on bf16 and fp32 logits with a
  152k vocabulary (not a multiple of the kernel's block), temperature 0.7, with and without the
  entropy and the in-place S;
* the whole head (`fused_shifted_logprobs`) with S kept from the forward, with S recomputed by
  chunks, and with the row kernel in eager PyTorch, against full logits -> log_softmax in fp32 on
  the same bf16 inputs: log-probs, entropy and the gradients of hidden states and head weight.

    pytest -q tests/gpu/test_head_kernels.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_entropy,write_s", [(False, False), (True, False), (False, True), (True, True)])
def test_row_kernel_matches_eager(dtype, with_entropy, write_s):
    from rlhfkit.models import head_kernels as hk

    if hk.triton is None:
        pytest.skip("no triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(97, 151_936, device="cuda", generator=g) * 6).to(dtype)
    t = torch.randint(0, z.shape[1], (97,), device="cuda", generator=g)
    z_ref, z_tri = z.clone(), z.clone()
    ref = hk.row_stats_eager(z_ref, t, 1 / 0.7, with_entropy, write_s)
    out = hk.row_stats(z_tri, t, 1 / 0.7, with_entropy, write_s)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=2e-5)
    if with_entropy:
        torch.testing.assert_close(out[2], ref[2], rtol=1e-4, atol=5e-4)  # nats; the sums' order differs
    if write_s:  # S = onehot - p: within one rounding step of the dtype
        tol = 8e-3 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(z_tri.float(), z_ref.float(), rtol=0, atol=tol)
        assert (z_tri.float().sum(-1)).abs().max() < 0.05  # each row of S sums to 0
    else:
        assert torch.equal(z_tri, z)


@pytest.mark.parametrize("mode", ["keep", "recompute", "eager"])
@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_fused_head_matches_full_logits(mode, entropy_in_loss, monkeypatch):
    from rlhfkit.models import fused_logprobs as fl

    monkeypatch.setattr(fl, "KEEP_LOGITS_BYTES", None if mode == "keep" else 0)
    monkeypatch.setattr(fl, "USE_TRITON", mode != "eager")
    torch.manual_seed(0)
    b, length, hdim, vocab, temp = 3, 333, 256, 50_000, 0.7
    hidden = (torch.randn(b, length, hdim, device="cuda") * 0.5).bfloat16()
    weight = (torch.randn(vocab, hdim, device="cuda") * 0.05).bfloat16()
    ids = torch.randint(0, vocab, (b, length), device="cuda")
    wl = torch.randn(b, length, device="cuda")
    we = torch.randn(b, length, device="cuda")

    def run(fused: bool):
        h = hidden.detach().clone().requires_grad_(True)
        w = weight.detach().clone().requires_grad_(True)
        if fused:
            lp, ent = fl.fused_shifted_logprobs(h, w, ids, temp, True, chunk_size=200)
        else:
            logp = torch.log_softmax((h.float() @ w.float().t()) / temp, -1)
            tgt = torch.roll(ids, -1, 1)
            lp = logp.gather(-1, tgt[..., None]).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
            zero = lp.new_zeros(b, 1)
            lp = torch.cat([zero, lp[:, :-1]], 1)
            ent = torch.cat([zero, ent[:, :-1]], 1)
        loss = (lp * wl).sum() + ((ent * we).sum() * 0.3 if entropy_in_loss else 0.0)
        loss.backward()
        return lp.detach(), ent.detach(), h.grad.float(), w.grad.float()

    got, ref = run(True), run(False)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-2, atol=2e-2)
    for a, r, name in ((got[2], ref[2], "hidden"), (got[3], ref[3], "weight")):
        rel = (a - r).norm() / r.norm()
        assert rel < 2e-2, f"grad of {name}: relative error {rel:.3g}"
