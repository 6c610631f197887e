"""Masked reductions over `[B, L]` per-token tensors, and batch whitening.

`mask` is 1 on the tokens that count (action tokens) and 0 elsewhere; it may be bool, int
or float. Masked sums and means run in float32 (or the input's wider dtype) so that bf16 inputs
do not lose precision in sums; whitening runs in float64 (two passes, see `whiten`).
"""

from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor


def _as_float(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x * mask` over `dim` (all elements when `dim` is None)."""
    prod = _as_float(x) * mask.to(_as_float(x).dtype)
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the masked elements; 0 where nothing is masked in."""
    m = mask.to(_as_float(x).dtype)
    num = masked_sum(x, m, dim)
    den = m.sum() if dim is None else m.sum(dim)
    return num / den.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Biased (population) variance of `x` over all masked elements."""
    mean = masked_mean(x, mask)
    return masked_mean((_as_float(x) - mean) ** 2, mask)


def whiten(x: Tensor, mask: Tensor, *, scale: bool = True, min_var: float = 1e-8,
           reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Batch whitening over every masked element: `(x - mu) / sigma`, zero off the mask.

    mu and sigma^2 are the masked mean and biased variance over the *whole* tensor (all
    rows), sigma^2 clamped to >= `min_var` (sigma >= 1e-4 by default, as OpenRLHF).
    `scale=False` only centres (`--no_advantage_std_norm`). `reduce` sums a tensor over ranks
    (e.g. an all-reduce), so that mu and sigma are those of the global batch.

    Two passes in float64: mu = sum(x) / n, then sigma^2 = sum((x - mu)^2) / n (each sum reduced
    over ranks, two small all-reduces). The one-pass E[x^2] - mu^2 cancels catastrophically when
    |mu| is large against sigma (REINFORCE++ returns near 1 with a small KL spread: off by 0.3).
    The result has the dtype of `x`.
    """
    xd = x.double()
    m = mask.to(torch.float64)
    first = torch.stack([(xd * m).sum(), m.sum()])
    if reduce is not None:
        first = reduce(first)
    mean = first[0] / first[1].clamp(min=1.0)
    out = xd - mean
    if scale:
        sq = ((out * out) * m).sum().reshape(1)
        if reduce is not None:
            sq = reduce(sq)
        var = (sq[0] / first[1].clamp(min=1.0)).clamp(min=min_var)
        out = out * var.rsqrt()
    return (out * m).to(x.dtype)
