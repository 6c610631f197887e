"""Packed == padded: log-probs, entropy and gradients of a tiny model, 4 samples of different lengths.

The packed row `[1, T]` carries position_ids restarting at 0 per sample and no attention mask;
the padded batch `[4, L]` is right padded with an attention mask. On the loss positions the
log-probs must agree within 1e-5 (fp32) and so must the gradient of the summed masked log-probs,
for Llama and Qwen2 (grouped-query attention), sdpa and eager attention, with transformers'
own packed-sequence detection ("auto") and with our block-diagonal mask ("block").
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.data.collate import pack_batch, pad_batch
from rlhfkit.data.items import SFTItem
from rlhfkit.models.forward import hf_detects_packing, token_logprobs

LENGTHS = (7, 12, 3, 9)


def _items(seed: int = 0) -> list[SFTItem]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(6, 100, (n,), generator=g).tolist()
        prompt = n // 3
        out.append(SFTItem(ids, [0] * prompt + [1] * (n - prompt)))
    return out


def _load(path: str, impl: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl)


def _logprobs_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    loss_mask = batch.pop("loss_mask")
    lp, ent = token_logprobs(model, return_entropy=True, **batch)
    (lp * loss_mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return lp.detach(), ent.detach(), grads


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("packed_mask", ["auto", "block"])
def test_packed_equals_padded(model_dir, impl, packed_mask):
    model = _load(model_dir, impl)
    items = _items()
    padded, packed = pad_batch(items, pad_id=0), pack_batch(items)

    lp_pad, ent_pad, g_pad = _logprobs_and_grads(
        model, input_ids=padded.input_ids, attention_mask=padded.attention_mask, loss_mask=padded.loss_mask)
    lp_pk, ent_pk, g_pk = _logprobs_and_grads(
        model, input_ids=packed.input_ids, position_ids=packed.position_ids, loss_mask=packed.loss_mask,
        packed_mask=packed_mask)

    on = padded.loss_mask.bool()
    assert on.sum() > 20
    assert torch.allclose(packed.to_padded(lp_pk)[on], lp_pad[on], atol=1e-5, rtol=0)
    assert torch.allclose(packed.to_padded(ent_pk)[on], ent_pad[on], atol=1e-5, rtol=0)
    # every position, not only the loss ones: sample starts are 0 in both layouts
    assert torch.allclose(packed.to_padded(lp_pk), lp_pad, atol=1e-5, rtol=0)
    for name, g in g_pad.items():
        assert torch.allclose(g_pk[name], g, atol=1e-5, rtol=1e-5), name


def test_transformers_detects_packed_positions(tiny_model_dir):
    """Our "auto" mode relies on this for sdpa/eager: HF masks packed samples from position_ids alone."""
    assert hf_detects_packing()
    model = _load(tiny_model_dir, "sdpa")
    items = _items(1)
    packed = pack_batch(items)
    with torch.no_grad():
        hf = token_logprobs(model, packed.input_ids, position_ids=packed.position_ids, packed_mask="hf")
        block = token_logprobs(model, packed.input_ids, position_ids=packed.position_ids, packed_mask="block")
    assert torch.allclose(hf, block, atol=1e-5)


def test_no_attention_leaks_between_packed_samples(tiny_model_dir):
    model = _load(tiny_model_dir, "sdpa")
    items = _items(2)
    changed = [SFTItem([t + 1 for t in items[0].input_ids], items[0].loss_mask)] + items[1:]
    with torch.no_grad():
        runs = []
        for its in (items, changed):
            p = pack_batch(its)
            runs.append(p.unpack(token_logprobs(model, p.input_ids, position_ids=p.position_ids)))
        # negative control: the same packed row seen as one padded sequence does leak
        p = pack_batch(items)
        leaky = p.unpack(token_logprobs(model, p.input_ids, attention_mask=torch.ones_like(p.input_ids),
                                        position_ids=p.position_ids))
    assert not torch.allclose(runs[0][0], runs[1][0])  # sample 0 itself changed
    for a, b in zip(runs[0][1:], runs[1][1:]):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)  # the others are untouched
    assert not torch.allclose(leaky[1][1:], runs[0][1][1:], atol=1e-3)


def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl,dtype,atol", [("sdpa", torch.float32, 1e-4), ("sdpa", torch.bfloat16, 5e-2),
                                             ("flash_attention_2", torch.bfloat16, 5e-2)])
def test_packed_equals_padded_cuda(tiny_model_dir, impl, dtype, atol):
    if impl == "flash_attention_2" and not _flash_available():
        pytest.skip("flash_attn is not installed")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype, attn_implementation=impl).cuda()
    items = _items(3)
    padded, packed = pad_batch(items, pad_id=0).to("cuda"), pack_batch(items).to("cuda")
    with torch.no_grad():
        lp_pad = token_logprobs(model, padded.input_ids, padded.attention_mask)
        lp_pk = token_logprobs(model, packed.input_ids, position_ids=packed.position_ids)
    on = padded.loss_mask.bool()
    assert lp_pk.dtype == torch.float32
    assert torch.allclose(packed.to_padded(lp_pk)[on], lp_pad[on], atol=atol, rtol=0)
