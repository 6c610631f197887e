"""The fused head + log-prob path equals logits -> log-softmax, values and gradients (fp32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhfkit.models.forward import token_logprobs


@pytest.mark.parametrize("temperature,entropy,use", [(1.0, False, "lp"), (0.7, True, "both"),
                                                     (0.7, True, "lp"), (1.0, True, "ent")])
@pytest.mark.parametrize("keep", ["recompute", "keep"])
def test_fused_equals_unfused(tiny_qwen2_dir, temperature, entropy, use, keep, monkeypatch):
    """`use`: which outputs reach the loss -- both, the log-probs only (the entropy a metric: the
    backward skips its term) or the entropy only (no log-prob gradient arrives). `keep`: S kept from
    the forward (one GEMM, no recompute) or recomputed by chunks in the backward."""
    from rlhfkit.models import fused_logprobs as fl

    monkeypatch.setattr(fl, "KEEP_LOGITS_BYTES", 1 << 40 if keep == "keep" else 0)
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, :3] = 0  # left padding too
    outs = []
    for fused in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
        res = token_logprobs(model, ids, attention_mask=mask, temperature=temperature, return_entropy=entropy,
                             fused=fused, chunk_size=5)  # chunks that cut through rows
        lp, ent = res if entropy else (res, None)
        w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
        loss = (lp * w).sum() if use != "ent" else 0.0
        if use != "lp":
            loss = loss + (ent * w).sum() * 0.3
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outs.append((lp.detach(), None if ent is None else ent.detach(), grads))
    (lp0, e0, g0), (lp1, e1, g1) = outs
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    if entropy:
        torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and "lm_head.weight" in g0
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=k)


def test_head_is_restored_after_a_failing_forward(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head = model.lm_head
    with pytest.raises(Exception):
        token_logprobs(model, torch.tensor([[1, 2, 10_000]]))  # id out of the vocabulary
    assert model.lm_head is head


def test_a_triton_kernel_that_fails_falls_back_to_pytorch_with_one_note(monkeypatch, caplog):
    import logging

    from rlhfkit.config import notes
    from rlhfkit.models import fused_logprobs as fl
    from rlhfkit.models import head_kernels as hk

    def broken(*a, **k):
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(fl, "USE_TRITON", True)
    monkeypatch.setattr(hk, "available", lambda z: True)
    monkeypatch.setattr(hk, "row_stats", broken)
    monkeypatch.setattr(notes, "_NOTED", set())
    caplog.set_level(logging.INFO)  # the note is a log record (printed once the CLI has set up logging)
    z = torch.randn(5, 40)
    t = torch.randint(0, 40, (5,))
    got = fl._row_stats(z.clone(), t, 1.0, True, False)
    ref = hk.row_stats_eager(z.clone(), t, 1.0, True, False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    assert fl.USE_TRITON is False
    assert caplog.text.count("Triton kernel failed (RuntimeError: no kernel image") == 1


def test_a_pass_without_grad_never_keeps_the_logits(monkeypatch):
    """Under no_grad (old-log-prob and reference passes) nothing is kept for a backward, even for a weight
    that requires grad: the rows are processed by chunks without writing S."""
    from rlhfkit.models import fused_logprobs as fl

    monkeypatch.setattr(fl, "KEEP_LOGITS_BYTES", 1 << 40)
    seen = []
    orig = fl._row_stats
    monkeypatch.setattr(fl, "_row_stats", lambda z, t, inv_t, ent, write_s, scale=None: (
        seen.append(write_s), orig(z, t, inv_t, ent, write_s, scale))[1])
    hidden, weight = torch.randn(2, 6, 8), torch.nn.Parameter(torch.randn(50, 8))
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        fl.fused_shifted_logprobs(hidden, weight, ids, 1.0, False, chunk_size=4)
    assert seen and not any(seen)  # chunks, no S
    seen.clear()
    fl.fused_shifted_logprobs(hidden, weight, ids, 1.0, False, chunk_size=4)[0].sum().backward()
    assert seen == [True]  # with a graph: one block for all rows, S kept
