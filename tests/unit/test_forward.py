"""token_logprobs: alignment, padding, entropy, temperature, chunked kernel vs a naive reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.models.forward import block_causal_mask, logprobs_from_logits, segment_ids, token_logprobs


def naive(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0):
    """Reference: full fp32 log_softmax, shifted so that column t scores ids[:, t]."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    lp = torch.zeros(ids.shape, dtype=torch.float32)
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = torch.zeros(ids.shape, dtype=torch.float32)
    ent[:, 1:] = -(logp.exp() * logp).sum(-1)[:, :-1]
    return lp, ent


@pytest.mark.parametrize("temperature,chunk", [(1.0, None), (0.7, 3), (1.3, 1)])
def test_kernel_matches_naive_values_and_grads(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=g)).requires_grad_()
    ids = torch.randint(0, 11, (2, 5), generator=g)
    w_lp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)

    lp, ent = logprobs_from_logits(logits, ids, temperature, return_entropy=True, chunk_size=chunk)
    (gl,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), logits)
    ref_lp, ref_ent = naive(logits, ids, temperature)
    (gr,) = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum(), logits)

    assert torch.allclose(lp, ref_lp, atol=1e-6) and torch.allclose(ent, ref_ent, atol=1e-6)
    assert torch.allclose(gl, gr, atol=1e-6)
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()


def test_kernel_bf16_logits_computed_in_fp32():
    g = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(1, 6, 50, generator=g)).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 50, (1, 6), generator=g)
    lp, _ = logprobs_from_logits(logits, ids, chunk_size=2)
    ref, _ = naive(logits.detach(), ids)  # fp32 math on the same bf16 values
    assert lp.dtype == torch.float32 and torch.allclose(lp, ref, atol=1e-5)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    assert grad.dtype == torch.bfloat16


def test_hand_computed_two_token_vocab():
    # logits favour token 1 by log(3): p = [1/4, 3/4]; token 1 after token 0 -> log(3/4)
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))], [0.0, 0.0]]])
    ids = torch.tensor([[0, 1]])
    lp, ent = logprobs_from_logits(logits, ids, return_entropy=True)
    h = -(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75)))
    assert torch.allclose(lp, torch.tensor([[0.0, torch.log(torch.tensor(0.75))]]))
    assert torch.allclose(ent, torch.tensor([[0.0, h]]))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")


def test_padded_batch_matches_single_sequences(model):
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(6, 100, (n,), generator=g) for n in (6, 3, 8)]
    width = 8
    for side in ("right", "left"):
        ids = torch.zeros(3, width, dtype=torch.long)
        mask = torch.zeros(3, width, dtype=torch.long)
        for r, s in enumerate(seqs):
            sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
            ids[r, sl], mask[r, sl] = s, 1
        lp, ent = token_logprobs(model, ids, mask, temperature=0.9, return_entropy=True)
        for r, s in enumerate(seqs):
            with torch.no_grad():
                ref_lp, ref_ent = naive(model(s[None]).logits, s[None], temperature=0.9)
            sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
            assert torch.allclose(lp[r, sl], ref_lp[0], atol=1e-5), side
            assert torch.allclose(ent[r, sl], ref_ent[0], atol=1e-5), side
        assert (lp[mask == 0] == 0).all() and (ent[mask == 0] == 0).all()


def test_block_mask_and_segments():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1]])
    assert segment_ids(pos).tolist() == [[0, 0, 0, 1, 2, 2]]
    allowed = block_causal_mask(pos, torch.float32)[0, 0] == 0
    expect = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                           [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expect)


def test_mask_known_padding_free_on_the_host_skips_the_mask_and_gives_the_same_logprobs(model, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    from rlhfkit.data.collate import PaddedBatch
    from rlhfkit.models.forward import forward_kwargs

    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(6, 100, (2, 7), generator=g)
    full = PaddedBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))
    padded = PaddedBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))
    padded.attention_mask[1, 5:] = 0
    moved, moved_padded = full.to("meta"), padded.to("meta")  # a copy, as to a GPU
    assert getattr(moved.attention_mask, "_rlhfkit_no_padding", False)
    assert not getattr(moved_padded.attention_mask, "_rlhfkit_no_padding", False)
    assert not getattr(full.attention_mask, "_rlhfkit_no_padding", False)  # the host batch is left as it is
    # a model that takes per-layer-type masks gets "causal, nothing masked"; others the mask itself
    assert forward_kwargs(qwen2, moved.attention_mask, None) == {"use_cache": False,
                                                                 "attention_mask": {"full_attention": None}}
    assert forward_kwargs(model, moved.attention_mask, None)["attention_mask"] is moved.attention_mask
    assert forward_kwargs(qwen2, moved_padded.attention_mask, None)["attention_mask"] is moved_padded.attention_mask
    # the same log-probs either way (the mask marked by hand: CPU tensors are not copied)
    marked = torch.ones_like(ids)
    marked._rlhfkit_no_padding = True
    a = token_logprobs(qwen2, ids, marked, return_entropy=False)
    b = token_logprobs(qwen2, ids, torch.ones_like(ids), return_entropy=False)
    assert torch.equal(a, b)
