"""Decode attention of the builtin engine's GPU decode step as one Triton kernel (a torch custom op).

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

The op mutates or reads only its arguments, so it sits inside torch.compile'd graphs and CUDA graph captures.
Kernels are launched with programmatic dependent launch where the GPU has it (triton_launch.py).
"""

from __future__ import annotations

import functools

import torch

from rlhfkit.rollout.builtin.kernels.triton_launch import pdl_launch, tl, triton


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

