"""Fused output projection + log-softmax: token log-probs without materialising `[N, V]` logits.

For a causal LM with a bias-free `lm_head` (weight `W [V, H]`), the log-prob of target y_n is

    z_n = W h_n / T,    logp_n = z_n[y_n] - logsumexp(z_n),    H_n = -sum_v p_nv log p_nv

Rows are processed in chunks: the forward keeps only the hidden states, `lse [N]` and the entropy;
the backward recomputes each chunk's logits and gives

    dL/dz_nv = g_n (1[v = y_n] - p_nv) - g^H_n p_nv (log p_nv + H_n)
    dL/dh_n  = (dL/dz_n / T) W,      dL/dW = sum_n (dL/dz_n / T)^T h_n

so peak memory is one chunk of logits instead of the whole `[N, V]` tensor (5 GB in bf16 for
8 x 2048 tokens and a 152k vocabulary). The same idea as Liger's fused linear cross-entropy,
written here for log-probs and entropy.

On CUDA the per-chunk element-wise work (upcast, log-sum-exp, gather, entropy; in backward the
softmax, the one-hot term and the downcast) runs as two torch.compile'd kernels that read the
chunk's low-precision logits once and keep fp32 values in registers (`COMPILE_CHUNKS`); the eager
path, used on CPU, materialises fp32 chunks and makes several passes over them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

CHUNK_BYTES = 1 << 30  # bytes of one chunk of logits (fp32 eager, compute dtype compiled)
COMPILE_CHUNKS = True  # compiled element-wise chunk kernels on CUDA


def _fwd_chunk(z: torch.Tensor, targets: torch.Tensor, inv_t: float, with_entropy: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-prob of the targets, log-sum-exp, entropy) of one chunk of logits `z` (any dtype)."""
    z = z.float() * inv_t
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lp, lse, None
    logp = z - lse[:, None]
    return lp, lse, -(logp.exp() * logp).sum(-1)


def _bwd_chunk(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
               g_lp: torch.Tensor, g_ent: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    """dL/dz of one chunk in z's dtype (see the module docstring for the formula)."""
    logp = z.float() * inv_t - lse[:, None]
    p = logp.exp()
    gz = -p * g_lp[:, None]
    if ent is not None and g_ent is not None:
        gz = gz - p * (logp + ent[:, None]) * g_ent[:, None]
    onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == targets[:, None]
    gz = gz + torch.where(onehot, g_lp[:, None], 0.0)
    return (gz * inv_t).to(z.dtype)


_COMPILED: dict[str, Any] = {}


def _compiled(name: str):
    if name not in _COMPILED:
        fn = {"fwd": _fwd_chunk, "bwd": _bwd_chunk}[name]
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def use_compiled_chunks(hidden: torch.Tensor) -> bool:
    return COMPILE_CHUNKS and hidden.is_cuda


class FusedLinearLogprobFn(torch.autograd.Function):
    """Chunked head + log-probs (module docstring); `compiled` runs each chunk's element-wise work
    in the two torch.compile'd kernels, else eagerly (same functions)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        w = weight.to(hidden.dtype)
        lp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_zeros(n if with_entropy else 0, dtype=torch.float32)
        fwd = _compiled("fwd") if compiled else _fwd_chunk
        for s in range(0, n, chunk):
            lp_c, lse_c, ent_c = fwd(hidden[s:s + chunk] @ w.t(), targets[s:s + chunk], 1.0 / temperature,
                                     with_entropy)
            lp[s:s + chunk], lse[s:s + chunk] = lp_c, lse_c
            if with_entropy:
                ent[s:s + chunk] = ent_c
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.compiled = temperature, chunk, with_entropy, compiled
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        w = weight.to(hidden.dtype)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        bwd = _compiled("bwd") if ctx.compiled else _bwd_chunk
        g_lp = g_lp.float()
        for s in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(s, s + ctx.chunk)
            h = hidden[sl]
            gz = bwd(h @ w.t(), targets[sl], lse[sl], ent[sl] if ctx.with_entropy else None, g_lp[sl],
                     g_ent[sl].float() if ctx.with_entropy else None, 1.0 / ctx.temperature)
            grad_h[sl] = gz @ w
            grad_w += (gz.t() @ h).float()
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def fusable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's `lm_head` when the fused path applies: a plain bias-free Linear, not sharded."""
    head = model._modules.get("lm_head")  # a direct child (not through a wrapper's __getattr__)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if type(head.weight).__name__ == "DTensor" or type(head.weight.data).__name__ == "DTensor":
        return None  # FSDP2-sharded: the weight only exists whole inside the module's own forward
    return head


class _HiddenTap(torch.nn.Module):
    """Stands in for `lm_head`: returns the hidden states and remembers their dtype (the model may
    upcast what it returns as logits; the projection must run in the compute dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        # under autocast the residual stream may be fp32 while lm_head would run in the autocast dtype
        self.dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        return x


@contextmanager
def head_bypassed(model: torch.nn.Module) -> Iterator[_HiddenTap]:
    """Within the block `model(...)` returns the final hidden states in place of the logits;
    `tap.dtype` is the dtype they had when they reached the head."""
    head = model.lm_head
    tap = _HiddenTap()
    model.lm_head = tap
    try:
        yield tap
    finally:
        model.lm_head = head


def fused_shifted_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                           temperature: float, return_entropy: bool, chunk_size: int | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like `logprobs_from_logits` but from hidden states `[B, L, H]` and the head weight `[V, H]`."""
    b, length, hdim = hidden.shape
    vocab = weight.shape[0]
    compiled = use_compiled_chunks(hidden)
    chunk = chunk_size or max(1, CHUNK_BYTES // ((hidden.element_size() if compiled else 4) * vocab))
    targets = torch.roll(input_ids, shifts=-1, dims=1).reshape(-1)
    lp, ent = FusedLinearLogprobFn.apply(hidden.reshape(b * length, hdim), weight, targets, float(temperature),
                                         chunk, return_entropy, compiled)
    zero = lp.new_zeros(b, 1)
    lp = torch.cat([zero, lp.view(b, length)[:, :-1]], dim=1)
    if not return_entropy:
        return lp, None
    return lp, torch.cat([zero, ent.view(b, length)[:, :-1]], dim=1)
