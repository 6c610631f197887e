"""Builtin engine pieces added for decode speed, checked on CPU:

- the final prefill layer restricted to each prompt's last position gives the same hidden state
  and K/V as the full layer (mixed prompt lengths, right padding);
- K/V written through a slice of evenly spaced slots equal those written through an index tensor;
- split-K partials `[S, B, H]` as the residual delta round like a GEMM output;
- the Triton GEMMs' split and launch choices (pure Python): the split divides K, does not depend on
  the number of rows, and the pipelined tiles are shrunk to the shared-memory budget.
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rollout.builtin.kernels import triton_gemm
from rlhfkit.rollout.builtin.model.decoder import DecoderModel, KVCache, _residual, prefill_layer
from rlhfkit.rollout.builtin.model.rope import rope_tables
from rlhfkit.rollout.builtin.model.weights import load_from_hf_model


@pytest.fixture(scope="module")
def model(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    spec, weights = load_from_hf_model(hf, torch.float32, torch.device("cpu"))
    cos, sin = rope_tables(hf.config, spec, 64, torch.float32, torch.device("cpu"))
    return hf, DecoderModel(spec, weights, cos, sin)


def test_last_position_layer_matches_full_layer(model):
    _, dm = model
    spec, layer = dm.spec, dm.weights.layers[-1]
    torch.manual_seed(0)
    lengths = torch.tensor([5, 12, 1, 9])
    x = torch.randn(4, 12, spec.hidden_size)
    cos, sin = dm.cos[:12, None, :], dm.sin[:12, None, :]
    full, k_full, v_full = prefill_layer(spec, layer, x, cos, sin, dm.scale)
    last, k_last, v_last = prefill_layer(spec, layer, x, cos, sin, dm.scale, lengths - 1)
    assert last.shape == (4, spec.hidden_size)
    torch.testing.assert_close(last, full[torch.arange(4), lengths - 1], rtol=1e-5, atol=1e-5)
    assert torch.equal(k_full, k_last) and torch.equal(v_full, v_last)
    # the restriction is not vacuous: a position before the last one has a different output
    assert not torch.allclose(full[1, 3], full[1, 11])


def test_prefill_logits_match_hf_with_slot_slice(model):
    hf, dm = model
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17]]
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(3, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    by_index = KVCache.allocate(dm.spec, 8, 64, torch.float32, torch.device("cpu"))
    by_slice = KVCache.allocate(dm.spec, 8, 64, torch.float32, torch.device("cpu"))
    slots = torch.tensor([1, 3, 5])
    logits = dm.prefill(by_index, tokens, lengths, slots)
    logits_sliced = dm.prefill(by_slice, tokens, lengths, slots, slice(1, 6, 2))
    assert torch.equal(logits, logits_sliced)
    for a, b in zip(by_index.k + by_index.v, by_slice.k + by_slice.v):
        assert torch.equal(a, b)
        assert a[slots].abs().sum() > 0 and a[[0, 2, 4]].abs().sum() == 0  # only the prompts' slots written
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, rtol=1e-4, atol=1e-4)


def test_residual_sums_partials_and_rounds_like_a_gemm_output():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    parts = torch.tensor([[[0.00390625, 1.0]], [[0.00390625, 0.5]]])  # [S=2, B=1, H=2] fp32
    got = _residual(x, parts)
    assert got.dtype == torch.bfloat16
    # sum first (0.0078125, 1.5), rounded to bf16, then added: 1.0078125 (exact in bf16), 3.5
    assert got.tolist() == [[1.0078125, 3.5]]
    plain = torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16)
    assert _residual(x, plain).tolist() == [[1.5, 2.25]]


@pytest.mark.parametrize("n,k", [(896, 896), (896, 4864), (1152, 896), (4096, 11008), (64, 96), (2048, 8192)])
def test_split_depends_on_the_weight_only_and_divides_k(n, k):
    s = triton_gemm.splits_for(n, k)
    assert s >= 1 and k % s == 0
    if s > 1:
        assert (k // s) % 64 == 0 and k // s >= 256
    for m in (1, 37, 64, 256):  # the launch adapts to the rows; the partials' shape does not
        cfg = triton_gemm.gemm_config(m, n, k, s)
        assert (k // s) % cfg["block_k"] == 0


def test_qwen2_05b_projections_are_split():
    assert triton_gemm.splits_for(896, 4864) == 4  # down: 14 column tiles x 4 slices
    assert triton_gemm.splits_for(896, 896) == 2  # o


@pytest.mark.parametrize("elem", [2, 4])
def test_tiles_are_shrunk_to_the_shared_memory_budget(elem):
    for m in (1, 64, 256):
        for cfg, tiles in ((triton_gemm.gemm_config(m, 896, 4864, 4), 1), (triton_gemm.gate_up_config(m, 4864, 896), 2)):
            fitted = triton_gemm._fit_smem(dict(cfg), elem, tiles)
            need = fitted["num_stages"] * (fitted["block_m"] + tiles * fitted["block_n"]) * fitted["block_k"] * elem
            assert need <= triton_gemm.SMEM_BUDGET
            if elem == 2:  # the measured bf16 configurations already fit: unchanged
                assert fitted == cfg
    # fp32 at small M: the 4-stage 128-long K tiles of the gate/up kernel would need 384 KiB
    big = triton_gemm.gate_up_config(1, 4864, 896)
    assert big["num_stages"] * (big["block_m"] + 2 * big["block_n"]) * big["block_k"] * 4 > triton_gemm.SMEM_BUDGET
