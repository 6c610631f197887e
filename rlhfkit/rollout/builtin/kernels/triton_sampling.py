"""The builtin engine's one-pass sampler on the GPU as Triton kernels (torch custom ops).

`rlhfkit::sample_partials(logits, temperature, stop_ids, ban_mask)`
    One pass over `[B, V]` logits in chunks of `SAMPLE_CHUNK` entries: per chunk the max and the
    sum of exp of the scaled logits z / T (for the log-sum-exp of the reported log-prob), the same
    sum without the row's banned stop ids (the chunk's sampling mass) and the argmax of the
    banned-masked scores (the greedy token). One exp per entry and no random numbers: sampling is
    hierarchical (`sampling.hierarchical_gumbel_argmax`): a chunk is drawn by Gumbel-max over the
    chunks' log-masses, then a token inside it, so only one chunk per row gets noise.
    `sampling.combine_partials` does the merge and the draw.

`rlhfkit::chunk_draw(logits, temperature, seeds, counters, stop_ids, ban_mask, log_mass) -> tokens [B]`
    The draw itself: the chunk by Gumbel-max over the chunk log-masses, then a token inside it, with the
    noise of `sampling.hierarchical_gumbel_argmax` computed in the kernel.

The ops read only their arguments, so they sit inside torch.compile'd graphs and CUDA graph captures.
Kernels are launched with programmatic dependent launch where the GPU has it (triton_launch.py).
"""

from __future__ import annotations

import os

import torch

from rlhfkit.rollout.builtin.kernels.triton_launch import pdl_launch, tl, triton

SAMPLE_CHUNK = 8192  # vocab entries per sampling program
SAMPLE_BLOCK = 1024  # entries per inner iteration
SAMPLE_WARPS = 4  # warps per sampling program


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _mix32(h):
        """lowbias32-style finaliser on uint32 (the same constants as `sampling._mix32`)."""
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x546CA68B
        return h ^ (h >> 16)

    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no libdevice

        @triton.jit
        def _fast_log2(x):
            return tl.log2(x)
    else:
        from triton.language.extra.cuda import libdevice

        @triton.jit
        def _fast_log2(x):
            return libdevice.fast_log2f(x)  # lg2.approx: ~2^-22 absolute error

    @triton.jit
    def _log_exponential(h):
        """ln(E) for the exponential variate E = -ln(u) of u = ((h >> 9) + 0.5) / 2^23 (so that
        x - ln(E) = x + Gumbel noise). Accurate in relative terms where it matters, E small
        (u near 1, the tokens that win): there E = -ln(1 - v) from the series in the exact
        v = 1 - u; elsewhere the hardware log2. Relative error of E below ~3e-6."""
        k = (h >> 9).to(tl.float32)
        u = (k + 0.5) * (1.0 / 8388608.0)
        v = (8388607.5 - k) * (1.0 / 8388608.0)
        series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * (0.25 + v * 0.2))))
        e = tl.where(v < 0.0625, series, _fast_log2(u) * -0.6931471805599453)
        return _fast_log2(e) * 0.6931471805599453


    @triton.jit
    def _chunk_draw_kernel(Logits, slb, Temp, Seeds, Counters, StopIds, Ban, sst, LogMass, Out, V, nchunks,
                           M: tl.constexpr, C_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
        """One row per program: a chunk by Gumbel-max over `LogMass [B, C]` (noise indices 2^31 + c),
        then a token by Gumbel-max over that chunk's banned-masked z / T (noise index = token id);
        the same hash as `sampling._gumbel`, in uint32."""
        if PDL:  # the log-masses come from the kernel before (settings too, after admissions)
            gdc_wait()
        row = tl.program_id(0)
        t = tl.load(Temp + row)
        inv_t = 1.0 / tl.where(t > 0, t, 1.0)
        seed = tl.load(Seeds + row)
        ctr = tl.load(Counters + row)
        lo32 = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi32 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key = _mix32(lo32 ^ _mix32(hi32 ^ _mix32((ctr & 0xFFFFFFFF).to(tl.uint32))))
        offs_c = tl.arange(0, C_PAD)
        lm = tl.load(LogMass + row * nchunks + offs_c, mask=offs_c < nchunks, other=float("-inf"))
        cnoise = _log_exponential(_mix32(key ^ _mix32(offs_c.to(tl.uint32) | (tl.full([C_PAD], 1, tl.uint32) << 31))))
        zc = tl.where(offs_c < nchunks, lm - cnoise, float("-inf"))
        best_c = tl.max(zc, 0)
        c = tl.min(tl.where(zc == best_c, offs_c, C_PAD), 0)
        any_ban = 0
        for j in tl.static_range(M):
            any_ban = any_ban | tl.load(Ban + row * sst + j).to(tl.int32)
        best_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        idx_vec = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + off + tl.arange(0, BLOCK)
            mask = offs < V
            x = tl.load(Logits + row * slb + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            z = x - _log_exponential(_mix32(key ^ _mix32(offs.to(tl.uint32))))
            if any_ban != 0:
                for j in tl.static_range(M):
                    sid = tl.load(StopIds + row * sst + j)
                    bj = tl.load(Ban + row * sst + j).to(tl.int32)
                    z = tl.where((offs == sid) & (bj != 0), float("-inf"), z)
            z = tl.where(mask, z, float("-inf"))
            take = z > best_vec
            best_vec = tl.where(take, z, best_vec)
            idx_vec = tl.where(take, offs, idx_vec)
        best = tl.max(best_vec, 0)
        tl.store(Out + row, tl.min(tl.where(best_vec == best, idx_vec, 2147483647), 0))

    @triton.jit
    def _sample_partial_kernel(Logits, slb, Temp, StopIds, Ban, sst, BestVal, BestIdx, ChunkMax, ChunkSum,
                               ChunkSumKept, V, nchunks, M: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
        """Lanes keep a running max, two sums of exp (all entries / entries not banned) and a running
        best (score, index) over the chunk's BLOCK-strided entries; one reduction each at the end."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        if PDL:  # the logits and the ban mask come from kernels before (settings too, after admissions)
            gdc_wait()
        t = tl.load(Temp + row)
        inv_t = 1.0 / tl.where(t > 0, t, 1.0)
        any_ban = 0
        for j in tl.static_range(M):
            any_ban = any_ban | tl.load(Ban + row * sst + j).to(tl.int32)
        m_vec = tl.full([BLOCK], -3.0e38, tl.float32)
        s_vec = tl.zeros([BLOCK], dtype=tl.float32)
        k_vec = tl.zeros([BLOCK], dtype=tl.float32)
        best_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        idx_vec = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + off + tl.arange(0, BLOCK)
            mask = offs < V
            x = tl.load(Logits + row * slb + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            kept = mask
            if any_ban != 0:
                for j in tl.static_range(M):
                    sid = tl.load(StopIds + row * sst + j)
                    bj = tl.load(Ban + row * sst + j).to(tl.int32)
                    kept = kept & ~((offs == sid) & (bj != 0))
            # online sums of exp with one exp per entry: exp(-|x - m|) rescales either the sums or x
            d = x - m_vec
            e = tl.exp(-tl.abs(d))
            up = d > 0
            s_vec = tl.where(up, s_vec * e + 1.0, s_vec + e)
            k_vec = tl.where(up, k_vec * e + tl.where(kept, 1.0, 0.0), k_vec + tl.where(kept, e, 0.0))
            m_vec = tl.maximum(m_vec, x)
            z = tl.where(kept, x, float("-inf"))
            take = z > best_vec
            best_vec = tl.where(take, z, best_vec)
            idx_vec = tl.where(take, offs, idx_vec)
        if PDL:
            gdc_launch_dependents()
        m = tl.max(m_vec, 0)
        scale = tl.exp(m_vec - m)
        s = tl.sum(s_vec * scale, 0)
        k = tl.sum(k_vec * scale, 0)
        best = tl.max(best_vec, 0)
        best_i = tl.min(tl.where(best_vec == best, idx_vec, 2147483647), 0)  # first index on ties
        out = row * nchunks + c
        tl.store(BestVal + out, best)
        tl.store(BestIdx + out, best_i)
        tl.store(ChunkMax + out, m)
        tl.store(ChunkSum + out, s)
        tl.store(ChunkSumKept + out, k)


def _num_chunks(vocab: int) -> int:
    return -(-vocab // SAMPLE_CHUNK)



@torch.library.custom_op("rlhfkit::sample_partials", mutates_args=())
def sample_partials(logits: torch.Tensor, temperature: torch.Tensor, stop_ids: torch.Tensor,
                    ban_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
    """Per vocab chunk of each row: (best banned-masked z / T, its token id, max of z / T,
    sum exp(z / T - max), the same sum over the tokens not banned), each `[B, chunks]`."""
    if triton is None:
        raise RuntimeError("rlhfkit::sample_partials needs Triton")
    rows, vocab = logits.shape
    nchunks = _num_chunks(vocab)
    dev = logits.device
    outs = [torch.empty((rows, nchunks), dtype=dt, device=dev)
            for dt in (torch.float32, torch.int32, torch.float32, torch.float32, torch.float32)]
    if rows == 0:
        return tuple(outs)  # type: ignore[return-value]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    stop_ids, ban = stop_ids.contiguous(), ban_mask.contiguous()
    _sample_partial_kernel[(rows, nchunks)](
        logits, logits.stride(0), temperature.contiguous(), stop_ids, ban, stop_ids.stride(0), *outs, vocab,
        nchunks, M=stop_ids.shape[1], CHUNK=SAMPLE_CHUNK, BLOCK=SAMPLE_BLOCK, num_warps=SAMPLE_WARPS,
        **pdl_launch(dev))
    return tuple(outs)  # type: ignore[return-value]


@torch.library.custom_op("rlhfkit::chunk_draw", mutates_args=())
def chunk_draw(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
               stop_ids: torch.Tensor, ban_mask: torch.Tensor, log_mass: torch.Tensor) -> torch.Tensor:
    """Token ids `[B]` (int32) drawn by `sampling.hierarchical_gumbel_argmax` from the chunk
    log-masses `log_mass [B, C]` and the logits (noise in the chosen chunk only)."""
    if triton is None:
        raise RuntimeError("rlhfkit::chunk_draw needs Triton")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    stop_ids, ban = stop_ids.contiguous(), ban_mask.contiguous()
    nchunks = log_mass.shape[1]
    _chunk_draw_kernel[(rows,)](
        logits, logits.stride(0), temperature.contiguous(), seeds.contiguous(), counters.contiguous(), stop_ids, ban,
        stop_ids.stride(0), log_mass.contiguous(), out, vocab, nchunks, M=stop_ids.shape[1],
        C_PAD=max(16, triton.next_power_of_2(nchunks)), CHUNK=SAMPLE_CHUNK, BLOCK=SAMPLE_BLOCK, num_warps=4,
        **pdl_launch(logits.device))
    return out


@chunk_draw.register_fake
def _chunk_draw_fake(logits, temperature, seeds, counters, stop_ids, ban_mask, log_mass):
    return torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)


@sample_partials.register_fake
def _sample_partials_fake(logits, temperature, stop_ids, ban_mask):
    rows, nchunks = logits.shape[0], _num_chunks(logits.shape[1])

    def e(dtype):
        return torch.empty((rows, nchunks), dtype=dtype, device=logits.device)

    return e(torch.float32), e(torch.int32), e(torch.float32), e(torch.float32), e(torch.float32)

