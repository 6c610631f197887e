"""Builtin engine on a GPU: parity with HF greedy `generate` on a random Qwen2-0.5B-shaped model.

fp32 (TF32 off): outputs must equal HF's token for token, except where HF's own top two logits
are within 1e-3 (a near-tie that fused GEMMs may break either way). bf16: divergences must also
be near-ties of HF's bf16 logits (gap < 0.25), and the log-prob gap against a teacher-forced HF
forward is measured and printed (and written to $OUT/engine_gpu_parity.json when $OUT is set).
Also: compile + CUDA graphs vs eager, sampled log-probs, weight update with graphs kept, sleep,
and the Triton kernels (fused RoPE + K/V write + attention; one-pass Gumbel sampler) against the
torch implementations they replace, on random inputs.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.builtin.loop.sampling import combine_partials, reference_partials, sample_tokens
from rlhfkit.rollout.builtin.model.decoder import _torch_decode_attention
from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.rollout.builtin.model.weights import LayerWeights
from rlhfkit.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6, pad_token_id=0)
LENGTHS = [5, 17, 33, 64, 100, 128, 200, 250]
MAX_NEW = [48, 64, 20, 64, 33, 64, 40, 64]
REPORT: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    if os.environ.get("OUT") and REPORT:
        with open(os.path.join(os.environ["OUT"], "engine_gpu_parity.json"), "w") as f:
            json.dump(REPORT, f, indent=1)


def _model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_05B), dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module")
def fp32_model():
    return _model(torch.float32)


@pytest.fixture(scope="module")
def bf16_model():
    return _model(torch.bfloat16)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 151000, (n,), generator=g).tolist() for n in LENGTHS]


_HF_CACHE: dict = {}


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    key = (id(model), tuple(prompt), max_new)  # the parity modes share one reference per prompt
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_greedy_uncached(model, prompt, max_new)
    return _HF_CACHE[key]


def _hf_greedy_uncached(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _divergence_gap(model, prompt: list[int], ours: list[int], ref: list[int]) -> tuple[int, float]:
    """(index of the first difference, HF logit of its token minus HF logit of ours there); (-1, 0) if equal."""
    if ours == ref:
        return -1, 0.0
    i = next(j for j in range(min(len(ours), len(ref))) if ours[j] != ref[j])
    logits = model(torch.tensor([prompt + ref[:i]], device="cuda")).logits[0, -1].float()
    return i, float(logits[ref[i]] - logits[ours[i]])


@torch.no_grad()
def _teacher_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    logits = model(torch.tensor([prompt + completion], device="cuda")).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, torch.tensor(completion, device="cuda")[:, None]).squeeze(1)


def _greedy_run(model, dtype, **cfg) -> list[list[int]]:
    config = BuiltinEngineConfig(max_num_seqs=4, max_model_len=320, sync_every=8, **cfg)
    engine = BuiltinEngine(model, None, device="cuda", dtype=dtype, config=config, eos_token_ids=[])
    reqs = [GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=m), i)
            for i, (p, m) in enumerate(zip(_prompts(), MAX_NEW))]
    outs = [o[0].token_ids for o in engine.generate(reqs)]
    assert engine.stats.mid_run_admissions >= 1
    assert engine.runner.compile_error is None  # no silent fallback from a fast path
    assert engine.model.attn == cfg.get("decode_attention", "triton")
    assert engine.model.gemm == "triton"  # used for batches of at least gemm_min_rows rows
    return outs


def _rope_tables(length: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.randn(length, dim // 2, device="cuda")
    return torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,kv_heads,dim,max_len", [(256, 14, 2, 64, 384), (3, 14, 2, 64, 1500),
                                                             (5, 8, 8, 128, 700), (2, 32, 4, 128, 4096)])
def test_triton_decode_attention_matches_torch(dtype, rows, heads, kv_heads, dim, max_len):
    """Fused kernel == RoPE + K/V write + SDPA over each row's own length (the second shape splits
    the positions over several programs); the cache is written at `pos` and nowhere else."""
    torch.manual_seed(rows)
    spec = ModelSpec("qwen2", 100, heads * dim, 1, heads, kv_heads, dim, 4, 1e-6, False, True, max_len)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.unflatten(-1, (heads, dim)), k.unflatten(-1, (kv_heads, dim)), v.unflatten(-1, (kv_heads, dim))
    caches = [torch.randn(rows + 1, kv_heads, max_len, dim, device="cuda", dtype=dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    pos = torch.randint(0, max_len, (rows,), device="cuda")
    pos[0], pos[-1] = max_len - 1, 0
    cos, sin = _rope_tables(max_len, dim, dtype)
    hidden = torch.arange(max_len, device="cuda")[None, :] > pos[:, None]
    bias = torch.zeros(hidden.shape, dtype=dtype, device="cuda").masked_fill(hidden, float("-inf"))[:, None, None, :]
    layer = LayerWeights(qkv=qkv, o=qkv)  # only `sinks` (None) and the layer's window (none) are read
    ref = _torch_decode_attention(spec, layer, q, k, v, *ref_caches, pos, cos, sin, bias, dim ** -0.5, True)
    out = torch.ops.rlhfkit.decode_attention(q, k, v, *caches, cos, sin, pos, dim ** -0.5)
    ref = ref.reshape(rows, heads, dim).float()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)  # bf16 RoPE rounding
    for c, r in zip(caches, ref_caches):
        assert torch.allclose(c.float(), r.float(), **tol)


def test_triton_sampler_matches_torch_sampler():
    """The kernel's per-chunk partials equal reference_partials; the same tokens as the torch
    hierarchical Gumbel-max sampler (the same hash, so at most a float near-tie may differ), log-probs of the temperature-scaled distribution, and banned stop ids never sampled."""
    torch.manual_seed(0)
    rows, vocab, m = 512, 151936, 8
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16)
    temp = torch.rand(rows, device="cuda") + 0.2
    temp[:64] = 0.0  # greedy rows
    seeds = torch.randint(0, 2**62, (rows,), device="cuda")
    counters = torch.randint(0, 5000, (rows,), device="cuda")
    stop = torch.randint(0, vocab, (rows, m), device="cuda")
    ban = torch.rand(rows, m, device="cuda") < 0.3
    greedy_top = logits.float().argmax(-1)
    stop[:16, 0], ban[:16, 0] = greedy_top[:16], True  # ban the greedy choice of 16 greedy rows
    args = (logits, temp, torch.ones(rows, device="cuda"), torch.full((rows,), vocab, device="cuda"), stop, ban,
            seeds, counters, False)
    ref_tok, ref_lp = sample_tokens(*args, fast=False)
    parts = torch.ops.rlhfkit.sample_partials(logits, temp, stop, ban)
    ref_parts = reference_partials(logits, temp, stop, ban)
    for a, b in zip(parts, ref_parts):
        if a.dtype == torch.int32:
            assert (a != b).float().mean().item() < 0.002  # greedy ids: float near-ties only
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    tok, lp = combine_partials(logits, temp, seeds, counters, stop, ban, *parts)
    assert (tok != ref_tok).sum().item() <= 1
    assert (lp - ref_lp).abs().max().item() < 1e-3
    assert not ((tok[:, None] == stop) & ban).any()
    assert torch.equal(tok[16:64], greedy_top[16:64])
    assert torch.equal(sample_tokens(*args)[0], tok)  # the dispatching entry point takes the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 37, 64, 256])
def test_triton_gemms_match_torch(dtype, m):
    from rlhfkit.rollout.builtin.kernels import triton_gemm

    torch.manual_seed(m)
    x = torch.randn(m, 896, device="cuda", dtype=dtype)
    xi = torch.randn(m, 4864, device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, n in ((x, 896), (xi, 896), (x, 1152)):
        w = torch.randn(n, a.shape[1], device="cuda", dtype=dtype) * 0.05
        parts = torch.ops.rlhfkit.mm_partials(a, w)
        assert parts.shape == (triton_gemm.splits_for(n, a.shape[1]), m, n) and parts.dtype == torch.float32
        ref = a.double() @ w.double().t()
        assert ((parts.sum(0).double() - ref).abs().max() / ref.abs().max()).item() < tol
    assert triton_gemm.splits_for(896, 4864) > 1  # the down projection is split
    w = torch.randn(2 * 4864, 896, device="cuda", dtype=dtype) * 0.05
    gate, up = (x @ w.t()).chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate.float()) * up.float())
    got = torch.ops.rlhfkit.gate_up_silu(x, w)
    assert got.shape == (m, 4864) and got.dtype == dtype
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 256])
def test_residual_rmsnorm_matches_torch(dtype, m):
    """The Triton residual add + RMSNorm over split-K partials == `_residual` then `rms_norm` (torch):
    bf16 equal up to one rounding step (the partials' fp32 sum may run in another order), fp32 within
    1e-5 (the kernel's rsqrt is the fast one, as inductor's)."""
    from rlhfkit.rollout.builtin.model.decoder import _residual, rms_norm

    torch.manual_seed(m)
    x = torch.randn(m, 896, device="cuda", dtype=dtype)
    parts = torch.randn(4, m, 896, device="cuda")
    w = (1 + 0.1 * torch.randn(896, device="cuda")).to(dtype)
    x_new, h = torch.ops.rlhfkit.residual_rmsnorm(x, parts, w, 1e-6)
    ref_x = _residual(x, parts)
    ref_h = rms_norm(ref_x, w, 1e-6)
    ulp = 1e-5 if dtype == torch.float32 else 2 ** -7
    for got, ref in ((x_new, ref_x), (h, ref_h)):
        assert got.dtype == dtype and got.shape == (m, 896)
        assert ((got.float() - ref.float()).abs() <= ulp * ref.float().abs() + 1e-6).all()
        if dtype == torch.bfloat16:
            assert (got == ref).float().mean().item() > 0.99


@pytest.mark.parametrize("mode", [dict(), dict(compile=False), dict(compile=False, cuda_graphs=False),
                                  dict(decode_attention="sdpa"), dict(decode_attention="matmul"),
                                  dict(gemm_min_rows=1), dict(gemm_min_rows=1, compile=False)])
def test_fp32_greedy_parity(fp32_model, mode):
    outs = _greedy_run(fp32_model, torch.float32, **mode)
    exact = 0
    for p, m, ours in zip(_prompts(), MAX_NEW, outs):
        ref = _hf_greedy(fp32_model, p, m)
        i, gap = _divergence_gap(fp32_model, p, ours, ref)
        assert len(ours) == m
        assert gap < 1e-3, f"prompt of {len(p)} tokens diverges at {i} where HF prefers its token by {gap}"
        exact += i == -1
    REPORT[f"fp32_exact_sequences_{'_'.join(f'{k}={v}' for k, v in mode.items()) or 'default'}"] = exact
    assert exact >= len(outs) - 1


@pytest.mark.parametrize("gemm_min_rows", [64, 1])
def test_bf16_greedy_parity_and_logprob_gap(bf16_model, fp32_model, gemm_min_rows):
    config = BuiltinEngineConfig(max_num_seqs=4, max_model_len=320, sync_every=8, gemm_min_rows=gemm_min_rows)
    engine = BuiltinEngine(bf16_model, None, device="cuda", dtype=torch.bfloat16, config=config, eos_token_ids=[])
    prompts = _prompts()
    outs = engine.generate([GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=m), i)
                            for i, (p, m) in enumerate(zip(prompts, MAX_NEW))])
    assert engine.runner.compile_error is None and engine.model.attn == "triton"
    exact, prefix, gaps, lp_bf16, lp_fp32 = 0, [], [], [], []
    for p, m, (c,) in zip(prompts, MAX_NEW, outs):
        ref = _hf_greedy(bf16_model, p, m)
        i, gap = _divergence_gap(bf16_model, p, c.token_ids, ref)
        assert gap < 0.25, f"bf16 divergence at {i} is not a near-tie of HF's logits (gap {gap})"
        exact += i == -1
        prefix.append(m if i == -1 else i)
        gaps.append(gap)
        ours = torch.tensor(c.logprobs, device="cuda")
        lp_bf16.append((ours - _teacher_logprobs(bf16_model, p, c.token_ids, 1.0)).abs())
        lp_fp32.append((ours - _teacher_logprobs(fp32_model, p, c.token_ids, 1.0)).abs())
    d16, d32 = torch.cat(lp_bf16), torch.cat(lp_fp32)
    tag = "" if gemm_min_rows > 4 else "_triton_gemm"
    REPORT.update({f"bf16{tag}_exact_sequences": exact, f"bf16{tag}_sequences": len(outs),
                   f"bf16{tag}_mean_common_prefix": sum(prefix) / len(prefix), f"bf16{tag}_divergence_gaps": gaps,
                   f"bf16{tag}_logprob_gap_vs_hf_bf16_mean": d16.mean().item(),
                   f"bf16{tag}_logprob_gap_vs_hf_bf16_max": d16.max().item(),
                   f"bf16{tag}_logprob_gap_vs_hf_fp32_mean": d32.mean().item(),
                   f"bf16{tag}_logprob_gap_vs_hf_fp32_max": d32.max().item()})
    print(json.dumps(REPORT))
    assert prefix[0] >= 1 and d16.mean().item() < 0.05


def test_fp32_sampled_logprobs_match_teacher_forcing(fp32_model):
    engine = BuiltinEngine(fp32_model, None, device="cuda", dtype=torch.float32, eos_token_ids=[],
                           config=BuiltinEngineConfig(max_num_seqs=8, max_model_len=320))
    prompts = _prompts()[:4]
    for sp in (SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=1),
               SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=24, n=2, seed=2)):
        outs = engine.generate([GenerationRequest(p, sp, i) for i, p in enumerate(prompts)])
        for p, comps in zip(prompts, outs):
            for c in comps:
                ref = _teacher_logprobs(fp32_model, p, c.token_ids, sp.temperature)
                assert (torch.tensor(c.logprobs, device="cuda") - ref).abs().max().item() < 1e-3
    assert engine.stats.prefill_sequences == 8  # 2 calls x 4 prompts, the n = 2 samples share it
    assert engine.runner.compile_error is None  # the compiled torch sampler (top-k / top-p) and the Triton one


def test_update_weights_keeps_graphs_and_sleep_frees_memory(bf16_model):
    import copy

    engine = BuiltinEngine(bf16_model, None, device="cuda", dtype=torch.bfloat16, eos_token_ids=[],
                           config=BuiltinEngineConfig(max_num_seqs=4, max_model_len=320))
    prompts = _prompts()[:3]
    reqs = [GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=16), i) for i, p in enumerate(prompts)]
    before = [o[0].token_ids for o in engine.generate(reqs)]
    captures = engine.runner.captures
    new = copy.deepcopy(bf16_model)
    with torch.no_grad():
        for prm in new.parameters():
            prm.add_(torch.randn_like(prm) * 0.02)
    engine.update_weights(new.state_dict().items())
    after = [o[0].token_ids for o in engine.generate(reqs)]
    assert engine.runner.captures == captures  # the same graphs replayed over the new weights
    assert after != before
    for p, ours in zip(prompts, after):
        assert _divergence_gap(new, p, ours, _hf_greedy(new, p, 16))[1] < 0.25
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    engine.sleep(2)
    freed = used - torch.cuda.memory_allocated()
    engine.wake_up()
    assert [o[0].token_ids for o in engine.generate(reqs)] == after
    weight_bytes = sum(p.numel() for p in bf16_model.parameters()) * 2
    assert freed >= weight_bytes


def test_fp32_greedy_repetition_penalty_parity(fp32_model):
    """The penalised sampler path compiled and in CUDA graphs: greedy tokens equal HF's with the same penalty."""
    config = BuiltinEngineConfig(max_num_seqs=4, max_model_len=320, sync_every=8)
    engine = BuiltinEngine(fp32_model, None, device="cuda", dtype=torch.float32, config=config, eos_token_ids=[])
    prompts = _prompts()[:4]
    sp = SamplingParams(temperature=0.0, max_new_tokens=32, repetition_penalty=1.3)
    outs = [o[0].token_ids for o in engine.generate([GenerationRequest(p, sp, i) for i, p in enumerate(prompts)])]
    assert engine.runner.compile_error is None
    exact = 0
    with torch.no_grad():
        for p, ours in zip(prompts, outs):
            ids = torch.tensor([p], device="cuda")
            ref = fp32_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                      repetition_penalty=1.3, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
            exact += ours == ref
    REPORT["fp32_repetition_penalty_exact_sequences"] = exact
    assert exact >= len(prompts) - 1
