"""Row kernels of the fused log-prob head (`fused_logprobs.py`): per row of logits `z [n, V]`

    lse = logsumexp(z / T),   lp = z[y] / T - lse,   H = lse - sum_v p_v z_v / T,   p = softmax(z / T)

and, with `write_s`, z overwritten in place by S = onehot(y) - p in z's dtype (the softmax's
gradient, which the backward multiplies into the head's two GEMMs), or, given the per-row gradient
`scale` = g, by dL/dz = g S / T itself.

`row_stats` is one Triton program per row: the first pass reads the row once with an online
log-sum-exp (a running max and rescaled sum per lane, as in FlashAttention's softmax)
and picks the target's logit; the second pass, only when S or the entropy is asked for, reads
the row again, accumulates sum p z for the entropy and writes S. So a row costs one read for the
log-probs alone, and two reads plus one write with S: memory-bound, no fp32 copy of the block.
`row_stats_eager` is the same in PyTorch, for CPU and as the reference in tests.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None
    tl = None

BLOCK = 4096  # vocabulary entries per inner iteration
WARPS = 8


def available(z: torch.Tensor) -> bool:
    return triton is not None and z.is_cuda and z.is_contiguous() and z.dtype in (
        torch.bfloat16, torch.float16, torch.float32)


def row_stats_eager(z: torch.Tensor, targets: torch.Tensor, inv_t: float, with_entropy: bool, write_s: bool,
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = z.float() * inv_t
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = None
    if with_entropy or write_s:
        p = (x - lse[:, None]).exp_()
        if with_entropy:
            ent = lse - (p * x).sum(-1)
        if write_s and scale is None:
            p.neg_().scatter_add_(-1, targets[:, None], torch.ones_like(lse)[:, None])
        elif write_s:  # (g onehot - g p) / T, in this order (the rounding of the unfused path's gradient)
            g = scale.float()[:, None]
            p.mul_(-g).scatter_add_(-1, targets[:, None], g).mul_(inv_t)
        if write_s:
            z.copy_(p)
    return lp, lse, ent


def grad_with_entropy(s: torch.Tensor, targets: torch.Tensor, ent: torch.Tensor, g_lp: torch.Tensor,
                      g_ent: torch.Tensor, inv_t: float) -> torch.Tensor:
    """dL/dz = (g_lp S - g_ent p (log p + H)) / T from S (p = onehot - S), in S's dtype."""
    sf = s.float()
    onehot = torch.zeros_like(sf).scatter_(-1, targets[:, None], 1.0)
    p = onehot - sf
    gz = sf * g_lp[:, None] - (torch.special.xlogy(p, p) + p * ent[:, None]) * g_ent[:, None]
    return (gz * inv_t).to(s.dtype)


if triton is not None:

    @triton.jit
    def _row_kernel(z_ptr, stride, tgt_ptr, lp_ptr, lse_ptr, ent_ptr, scale_ptr, V, inv_t,
                    WRITE_S: tl.constexpr, WITH_ENT: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -1.0e30, tl.float32)  # finite: exp(m - m_new) stays defined on empty lanes
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + lanes
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, x)
            acc = acc * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        mx = tl.max(m, axis=0)
        lse = mx + tl.log(tl.sum(acc * tl.exp(m - mx), axis=0))
        tgt = tl.load(tgt_ptr + row)
        zt = tl.load(base + tgt).to(tl.float32) * inv_t
        tl.store(lp_ptr + row, zt - lse)
        tl.store(lse_ptr + row, lse)
        if WRITE_S or WITH_ENT:
            px = tl.zeros([BLOCK], tl.float32)
            row_scale = tl.load(scale_ptr + row) if SCALED else 1.0
            for start in range(0, V, BLOCK):
                cols = start + lanes
                inb = cols < V
                x = tl.load(base + cols, mask=inb, other=0.0).to(tl.float32) * inv_t
                p = tl.exp(x - lse)
                if WITH_ENT:
                    px += tl.where(inb, p * x, 0.0)
                if WRITE_S:
                    if SCALED:  # dL/dz = (g onehot - g p) / T
                        s = (tl.where(cols == tgt, row_scale, 0.0) - p * row_scale) * inv_t
                    else:
                        s = tl.where(cols == tgt, 1.0, 0.0) - p
                    tl.store(base + cols, s.to(z_ptr.dtype.element_ty), mask=inb)
            if WITH_ENT:
                tl.store(ent_ptr + row, lse - tl.sum(px, axis=0))


def row_stats(z: torch.Tensor, targets: torch.Tensor, inv_t: float, with_entropy: bool, write_s: bool,
              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n, vocab = z.shape
    lp = torch.empty(n, dtype=torch.float32, device=z.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if with_entropy else lp
    if n:
        row_scale = scale.float().contiguous() if scale is not None else lp
        _row_kernel[(n,)](z, z.stride(0), targets.contiguous(), lp, lse, ent, row_scale, vocab, float(inv_t),
                          WRITE_S=write_s, WITH_ENT=with_entropy, SCALED=scale is not None, BLOCK=BLOCK,
                          num_warps=WARPS)
    return lp, lse, ent if with_entropy else None
