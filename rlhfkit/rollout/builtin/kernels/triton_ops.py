"""Triton kernels of the builtin engine's GPU decode step, exposed as torch custom ops.

Two kernels replace the parts of a decode step that cost most outside the GEMMs:

`rlhfkit::decode_attention(q, k, v, k_cache, v_cache, cos, sin, pos, scale) -> out [B, Hq, D]`
    Fused RoPE + KV-cache write + grouped-query attention for one new token per row (row b = slot b).
    One program per (row, KV head, split) applies RoPE to the row's G = Hq / KV query heads and to
    the new key, stores the new key/value at `pos[b]`, and runs the online-softmax recurrence of
    FlashAttention over cache positions `< pos[b]` plus the new
    token, whose key and value it still holds in registers. The G query heads of a KV head form the
    rows of one `tl.dot`, so K/V are read once per KV head (GQA). The
    loop bound comes from `pos` on the device, so one captured CUDA graph serves
    every context length and no row reads past its own length. Small batches split the positions
    over `splits` programs (flash-decoding) whose partial results a second kernel merges by their
    log-sum-exp.

`rlhfkit::sample_partials(logits, temperature, stop_ids, ban_mask)`
    One pass over `[B, V]` logits in chunks of `SAMPLE_CHUNK` entries: per chunk the max and the
    sum of exp of the scaled logits z / T (for the log-sum-exp of the reported log-prob), the same
    sum without the row's banned stop ids (the chunk's sampling mass) and the argmax of the
    banned-masked scores (the greedy token). One exp per entry and no random numbers: sampling is
    hierarchical (`sampling.hierarchical_gumbel_argmax`): a chunk is drawn by Gumbel-max over the
    chunks' log-masses, then a token inside it, so only one chunk per row gets noise.
    `sampling.combine_partials` does the merge and the draw.

Both ops mutate or read only their arguments, so they sit inside torch.compile'd graphs and CUDA
graph captures. `available()` says whether Triton can be used (a CUDA device and the package).

Programmatic dependent launch (`use_pdl`, Hopper and newer): the kernels here and in triton_gemm
are launched with `launch_pdl`, so the GPU may start a kernel while the one before it in the
stream is still finishing. Each kernel reads only what no unfinished kernel writes (positions,
rope tables, sampling settings) before `griddepcontrol.wait`, which returns once the previous
kernel has finished and its writes are visible, and signals its own dependents once its main
loop is done. Every such kernel waits before it finishes, so a kernel's predecessors are all done
once it is. The decode step's kernel boundaries (launch, prologue, the previous kernel's tail)
then overlap instead of adding up.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None
    tl = None

SAMPLE_CHUNK = 8192  # vocab entries per sampling program
SAMPLE_BLOCK = 1024  # entries per inner iteration
SAMPLE_WARPS = 4  # warps per sampling program


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


# None: programmatic dependent launch where the GPU has it (compute capability >= 9) and
# RLHFKIT_PDL is not "0"; True / False force it (benchmarks)
PDL_CONFIG: dict = {"enabled": None}


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch."""
    if triton is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if PDL_CONFIG["enabled"] is not None:
        return bool(PDL_CONFIG["enabled"])
    return os.environ.get("RLHFKIT_PDL", "1") != "0" and _pdl_capable(device.index or 0)


def pdl_launch(device: torch.device) -> dict:
    """Launch keyword arguments of a kernel with a `PDL` constexpr: `PDL=...` and `launch_pdl`."""
    on = use_pdl(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes the attention kernel handles: power-of-two head_dim in [16, 256], G <= 64."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return False
    return (head_dim & (head_dim - 1)) == 0 and 16 <= head_dim <= 256 and num_heads // num_kv_heads <= 64


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# launch parameters of the attention kernel; None = chosen per launch by `attention_launch`
ATTN_CONFIG: dict = {"block_n": None, "num_warps": None, "num_stages": None, "splits": None, "min_chunk": 512}


def attention_splits(rows: int, kv_heads: int, max_len: int, num_sms: int, min_chunk: int = 512) -> int:
    """Position splits per (row, KV head): enough programs for about two waves of the GPU, each
    split at least `min_chunk` positions long (at most 16 splits): below that, the merge kernel a
    split needs per layer costs more than the split gains."""
    want = -(-2 * num_sms // max(rows * kv_heads, 1))
    return max(1, min(want, max_len // min_chunk, 16))


def attention_launch(rows: int, kv_heads: int, head_dim: int, max_len: int, num_sms: int) -> dict:
    """Launch parameters: with two waves of (row, KV head) programs, 64-position tiles and two
    stages; fewer programs take 128-position tiles (64 for head_dim > 64) and three stages (the
    faster of the two at both batch sizes bench/rollout.py runs). head_dim 256 (Gemma 3) takes
    32-position tiles in two stages, so that K and V tiles fit shared memory."""
    many = rows * kv_heads >= 2 * num_sms
    cfg = {"block_n": 64 if many or head_dim > 64 else 128, "num_warps": 4, "num_stages": 2 if many else 3}
    if head_dim > 128:
        cfg.update(block_n=32, num_stages=2)
    cfg = {k: ATTN_CONFIG[k] or v for k, v in cfg.items()}
    cfg["splits"] = ATTN_CONFIG["splits"] or attention_splits(rows, kv_heads, max_len, num_sms,
                                                              ATTN_CONFIG["min_chunk"])
    return cfg


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _rope(x, xp, cos, sin, sign):
        """Rotate-half RoPE in fp32: x * cos + rotate_half(x) * sin, `xp` = x at (d + D/2) mod D."""
        return x * cos + sign * xp * sin

    @triton.jit
    def _decode_attn_kernel(Q, K, V, KC, VC, Cos, Sin, Pos, Sinks, Out, PartO, PartL,
                            sqb, sqh, skb, skh, svb, svh, scb, sch, scl, scos, sob, soh,
                            scale, chunk, window,
                            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLITS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr, ROT: tl.constexpr,
                            HAS_SINKS: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        pos = tl.load(Pos + b).to(tl.int32)
        dt = KC.dtype.element_ty
        offs_d = tl.arange(0, D)
        # rotate-half over the first ROT dims; past them the tables hold cos 1, sin 0 (partial rotary)
        offs_rot = tl.where(offs_d < ROT, (offs_d + ROT // 2) % ROT, offs_d)
        sign = tl.where(offs_d < ROT // 2, -1.0, 1.0)
        cos = tl.load(Cos + pos * scos + offs_d).to(tl.float32)
        sin = tl.load(Sin + pos * scos + offs_d).to(tl.float32)
        if PDL:  # q, k, v come from the kernel before
            gdc_wait()
        offs_g = tl.arange(0, G_PAD)
        gmask = offs_g < G
        qrow = Q + b * sqb + (kvh * G + offs_g)[:, None] * sqh
        q = tl.load(qrow + offs_d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        qp = tl.load(qrow + offs_rot[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        q = _rope(q, qp, cos[None, :], sin[None, :], sign[None, :]).to(dt)
        krow = K + b * skb + kvh * skh
        kn = _rope(tl.load(krow + offs_d).to(tl.float32), tl.load(krow + offs_rot).to(tl.float32), cos, sin,
                   sign).to(dt)
        vn = tl.load(V + b * svb + kvh * svh + offs_d)
        base = b * scb + kvh * sch
        first = split == 0
        tl.store(KC + base + pos * scl + offs_d, kn, mask=(offs_d < D) & first)
        tl.store(VC + base + pos * scl + offs_d, vn, mask=(offs_d < D) & first)
        # the new token (held in registers) opens the recurrence of split 0
        s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1) * scale
        m = tl.where(first, s_new, float("-inf"))
        l_i = tl.where(first, 1.0, 0.0) + tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.where(first, 1.0, 0.0) * vn.to(tl.float32)[None, :] + tl.zeros([G_PAD, D], dtype=tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, pos)
        if window > 0:  # keys older than the window (j <= pos - window) are not visible
            lo = tl.maximum(lo, pos - window + 1)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < hi
            ptrs = base + offs_n[:, None] * scl + offs_d[None, :]
            k = tl.load(KC + ptrs, mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + ptrs, mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=PREC)
            m = m_new
        if PDL:
            gdc_launch_dependents()
        heads = kvh * G + offs_g
        if SPLITS == 1:
            if HAS_SINKS:  # the sink logit joins the denominator and carries no value
                sink = tl.load(Sinks + heads, mask=gmask, other=0.0).to(tl.float32)
                m_f = tl.maximum(m, sink)
                acc = acc * tl.exp(m - m_f)[:, None]
                l_i = l_i * tl.exp(m - m_f) + tl.exp(sink - m_f)
            out = acc / l_i[:, None]
            tl.store(Out + b * sob + heads[:, None] * soh + offs_d[None, :], out.to(Out.dtype.element_ty),
                     mask=gmask[:, None])
        else:
            safe = tl.where(l_i > 0, l_i, 1.0)
            part = (b * (G * tl.num_programs(1)) + heads) * SPLITS + split  # [G_PAD] rows of [B, Hq, SPLITS]
            tl.store(PartO + part[:, None] * D + offs_d[None, :], acc / safe[:, None], mask=gmask[:, None])
            tl.store(PartL + part, m + tl.log(l_i), mask=gmask)

    @triton.jit
    def _merge_splits_kernel(PartO, PartL, Sinks, Out, sob, soh, H, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                             D: tl.constexpr, PDL: tl.constexpr, HAS_SINKS: tl.constexpr):
        if PDL:
            gdc_wait()
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, S_PAD)
        smask = offs_s < SPLITS
        row = (b * H + h) * SPLITS
        lse = tl.load(PartL + row + offs_s, mask=smask, other=float("-inf"))
        top = tl.max(lse, 0)
        if HAS_SINKS:
            sink = tl.load(Sinks + h).to(tl.float32)
            top = tl.maximum(top, sink)
            w = tl.exp(lse - top)
            w = w / (tl.sum(w, 0) + tl.exp(sink - top))
        else:
            w = tl.exp(lse - top)
            w = w / tl.sum(w, 0)
        offs_d = tl.arange(0, D)
        o = tl.load(PartO + (row + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(w[:, None] * o, 0)
        tl.store(Out + b * sob + h * soh + offs_d, out.to(Out.dtype.element_ty))

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


# ---------------------------------------------------------------- decode attention op
@torch.library.custom_op("rlhfkit::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                     scale: float, window: int = 0, sinks: torch.Tensor | None = None,
                     rotary_dim: int = 0) -> torch.Tensor:
    """q `[B, Hq, D]`, k/v `[B, KV, D]` (q, k before RoPE; any strides with a unit last one), caches
    `[S, KV, L, D]` (row b = slot b), rope tables `[>= L, D]`, pos `[B]` -> attention output `[B, Hq, D]`.
    `window` > 0: only keys j > pos - window are visible; `sinks [Hq]`: one logit per head added to
    the softmax's denominator; `rotary_dim` > 0: only the first `rotary_dim` dims rotate."""
    if triton is None:
        raise RuntimeError("rlhfkit::decode_attention needs Triton")
    rows, hq, d = q.shape
    kvh, max_len = k_cache.shape[1], k_cache.shape[2]
    g = hq // kvh
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1 \
            or k.stride(-1) != 1 or v.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("decode_attention: unexpected strides")
    out = torch.empty((rows, hq, d), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    cfg = attention_launch(rows, kvh, d, max_len, _num_sms(q.device.index or 0))
    block_n, splits = cfg["block_n"], cfg["splits"]
    per_split = -(-max_len // splits)
    chunk = -(-per_split // block_n) * block_n
    if splits > 1:
        part_o = torch.empty((rows, hq, splits, d), dtype=torch.float32, device=q.device)
        part_l = torch.empty((rows, hq, splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_l = out
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    has_sinks = sinks is not None
    sinks_arg = sinks.contiguous() if sinks is not None else pos  # any pointer when there are no sinks
    _decode_attn_kernel[(rows, kvh, splits)](
        q, k, v, k_cache, v_cache, cos, sin, pos, sinks_arg, out, part_o, part_l,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0), out.stride(0), out.stride(1),
        scale, chunk, window, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n,
        SPLITS=splits, PREC=prec, ROT=rotary_dim or d, HAS_SINKS=has_sinks and splits == 1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q.device))
    if splits > 1:
        _merge_splits_kernel[(rows, hq)](part_o, part_l, sinks_arg, out, out.stride(0), out.stride(1), hq,
                                         SPLITS=splits, S_PAD=triton.next_power_of_2(splits), D=d,
                                         HAS_SINKS=has_sinks, num_warps=1, **pdl_launch(q.device))
    return out


@decode_attention.register_fake
def _decode_attention_fake(q, k, v, k_cache, v_cache, cos, sin, pos, scale, window=0, sinks=None, rotary_dim=0):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# ---------------------------------------------------------------- sampling op
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
