"""The builtin engine's RMSNorm as one Triton kernel, for the eager decode step and prefill on CUDA.

An RMSNorm in fp32 is six or more kernels eagerly (cast, square, mean, rsqrt, scale, cast back) and a
residual add before it one more; Gemma 3 has six norms per layer, OLMo 2 four. Two custom ops replace
them, one program per row of the last dimension:

`rlhfkit::rms_norm(x [..., H], weight [H], eps, style) -> h`
`rlhfkit::add_rms_norm(x [..., H], delta [..., H], weight [H], eps, style) -> (x + delta, h)`

`h` is `decoder.rms_norm` (model/decoder.py) of the (summed) rows in one of the families' roundings (`STYLES`: "llama"
casts the normalised row back and scales in the model dtype, "fp32" scales in fp32, "gemma" by
1 + weight in fp32); the sum `x + delta` rounds to x's dtype as torch's add does. Inputs may be views
whose rows are strided (a q or k slice of the fused QKV output, its heads): the kernel walks two
leading dimensions by their strides, so no copy is made. Unlike torch.compile'd norms the kernels
need no graph tracing: a new shape costs nothing and a new (H, style) one Triton compilation
(cached on disk by Triton), which keeps a short run's first step short.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

STYLES = {"llama": 0, "fp32": 1, "gemma": 2}


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def applies(x: torch.Tensor, weight: torch.Tensor, style: str = "llama") -> bool:
    """Whether the kernels take this call: on a GPU with Triton, a unit stride along H, and the
    weight in x's dtype, or in fp32 where `style` scales in fp32 anyway (gpt-oss keeps its norm
    weights in fp32; a Llama-style product would be promoted to fp32 by torch)."""
    weight_ok = weight.dtype == x.dtype or (style != "llama" and weight.dtype == torch.float32)
    return (triton is not None and x.is_cuda and x.dim() >= 2 and x.stride(-1) == 1
            and weight_ok and weight.is_contiguous())


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, D, Wt, XO, HO, M2, H, sx1, sx2, sd1, sd2, eps, STYLE: tl.constexpr,
                         ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        i1, i2 = row // M2, row % M2
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        dt = HO.dtype.element_ty
        x = tl.load(X + i1 * sx1 + i2 * sx2 + offs, mask=mask, other=0.0)
        if ADD:
            d = tl.load(D + i1 * sd1 + i2 * sd2 + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(dt)
            tl.store(XO + row * H + offs, x, mask=mask)
        xf = x.to(tl.float32)
        xn = xf * tl.math.rsqrt(tl.sum(xf * xf, 0) / H + eps)
        w = tl.load(Wt + offs, mask=mask, other=0.0).to(tl.float32)
        if STYLE == 0:
            h = w * xn.to(dt).to(tl.float32)
        elif STYLE == 1:
            h = w * xn
        else:
            h = (w + 1.0) * xn
        tl.store(HO + row * H + offs, h.to(dt), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as `[M1, M2, H]` without a copy where its strides allow (a strided view otherwise copied)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    lead = t.reshape(-1, t.shape[-2], t.shape[-1]) if t.dim() > 3 else t
    return lead if lead.stride(-1) == 1 else lead.contiguous()


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
            style: int) -> tuple[torch.Tensor, torch.Tensor]:
    if triton is None:
        raise RuntimeError("rlhfkit::rms_norm needs Triton")
    if style not in STYLES.values():
        raise ValueError(f"rms_norm: style {style} is not one of {sorted(STYLES.values())}")
    hdim = x.shape[-1]
    if weight.shape != (hdim,):
        raise ValueError(f"rms_norm: weight [{hdim}] expected, got {tuple(weight.shape)}")
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x_new = torch.empty_like(h) if delta is not None else h
    x3 = _rows(x)
    d3 = _rows(delta) if delta is not None else x3
    m1, m2 = x3.shape[0], x3.shape[1]
    if m1 * m2 == 0:
        return x_new, h
    _rms_norm_kernel[(m1 * m2,)](x3, d3, weight, x_new, h, m2, hdim, x3.stride(0), x3.stride(1), d3.stride(0),
                                 d3.stride(1), eps, STYLE=style, ADD=delta is not None,
                                 BLOCK=triton.next_power_of_2(hdim), num_warps=4 if hdim <= 4096 else 8)
    return x_new, h


@torch.library.custom_op("rlhfkit::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: int) -> torch.Tensor:
    """RMSNorm of the rows of `x [..., H]` by `weight [H]` in the rounding `style` (`STYLES`)."""
    return _launch(x, None, weight, eps, style)[1]


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps, style):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("rlhfkit::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 style: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, RMSNorm(x + delta))`, the sum rounded to x's dtype (`delta` has x's shape)."""
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} {delta.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return _launch(x, delta, weight, eps, style)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, delta, weight, eps, style):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device))
