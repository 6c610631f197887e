"""Token log-probs and entropy from vocabulary-sharded logits, without gathering the vocabulary.

Under tensor parallelism (parallel/tensor_parallel.py) `lm_head` is split by rows: tensor-parallel
rank r holds the logits of vocabulary ids [r * V_r, (r + 1) * V_r) for every position. With
z = logits / T, the log-prob of target y and the entropy need only three numbers per row from
each rank, combined by two all-reduces over the tensor-parallel group:

    m    = max_r max_j z_j                                      (all-reduce MAX)
    S    = sum_r sum_j exp(z_j - m),  Z = sum_r sum_j exp(z_j - m) z_j,
    z_y  = sum_r [y in rank r's range] z_y                      (one stacked all-reduce SUM)
    lse  = m + log S,   log p_y = z_y - lse,   H = lse - Z / S

Backward (`VocabParallelLogprobFn`) needs no collective: every tensor-parallel rank holds the same
loss, so the gradient for rank r's logits is the local part of the full formula
(p = softmax(z), computed from the saved global lse and H):

    d log p_y / dz_j = 1[j = y] - p_j        (the one-hot only on the rank that owns y)
    d H / dz_j       = -p_j (log p_j + H)

and the rows' gradients to the hidden states are summed over the group by the column-parallel
`lm_head`'s own backward. Rows whose upstream gradients are both 0 (padding) get exactly 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist

DEFAULT_CHUNK_BYTES = 1 << 28  # fp32 bytes of one chunk of rows x (local) vocabulary; forward.py's too


def _z(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


class VocabParallelLogprobFn(torch.autograd.Function):
    """(log p(target), entropy) `[N]` of local logits `[N, V_r]` whose vocabulary starts at `offset`."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, offset: int, group: Any,
                temperature: float, chunk: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n, v_local = logits.shape
        local_t = targets - offset
        owned = (local_t >= 0) & (local_t < v_local)
        local_t = torch.where(owned, local_t, 0)
        m = logits.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            m[s: s + chunk] = _z(logits[s: s + chunk], temperature).amax(-1)
        if group is not None:
            tdist.all_reduce(m, op=tdist.ReduceOp.MAX, group=group)
        sums = logits.new_zeros(3, n, dtype=torch.float32)  # S, Z, z_y
        for s in range(0, n, chunk):
            sl = slice(s, s + chunk)
            z = _z(logits[sl], temperature)
            e = torch.exp(z - m[sl, None])
            sums[0, sl] = e.sum(-1)
            if with_entropy:
                sums[1, sl] = (e * z).sum(-1)
            sums[2, sl] = torch.where(owned[sl], z.gather(-1, local_t[sl, None]).squeeze(-1), 0.0)
        if group is not None:
            tdist.all_reduce(sums, op=tdist.ReduceOp.SUM, group=group)
        lse = m + torch.log(sums[0])
        lp = sums[2] - lse
        ent = lse - sums[1] / sums[0] if with_entropy else lse.new_zeros(0)
        ctx.save_for_backward(logits, local_t, owned, lse, ent)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple[Any, ...]:
        logits, local_t, owned, lse, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            sl = slice(s, s + chunk)
            logp = _z(logits[sl], t) - lse[sl, None]
            p = torch.exp(logp)
            g = g_lp[sl]
            gz = -p * g[:, None]
            gz.scatter_add_(-1, local_t[sl, None], torch.where(owned[sl], g, 0.0)[:, None])
            active = g != 0
            if ctx.with_entropy:
                gz = gz - p * (logp + ent[sl, None]) * g_ent[sl, None]
                active = active | (g_ent[sl] != 0)
            grad[sl] = torch.where(active[:, None], gz / t, 0.0).to(grad.dtype)
        return grad, None, None, None, None, None, None


def chunk_rows(v_local: int, chunk_size: int | None) -> int:
    """Rows per chunk of a `[rows, v_local]` fp32 block: `chunk_size`, else DEFAULT_CHUNK_BYTES' worth."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return chunk_size
    return max(1, DEFAULT_CHUNK_BYTES // (4 * v_local))


def vocab_parallel_logprobs(local_logits: torch.Tensor, input_ids: torch.Tensor, offset: int, group: Any,
                            temperature: float = 1.0, return_entropy: bool = False,
                            chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shifted log-probs `[B, L]` (and entropy) from this rank's logits `[B, L, V_r]` (vocabulary ids
    `offset` .. `offset + V_r - 1`); column 0 is 0, as `forward.logprobs_from_logits`. `group`: the
    tensor-parallel process group (None: one rank holds the whole vocabulary)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    b, length, v_local = local_logits.shape
    targets = torch.roll(input_ids, shifts=-1, dims=1).reshape(-1)  # last column: unused
    lp, ent = VocabParallelLogprobFn.apply(local_logits.reshape(b * length, v_local), targets, int(offset), group,
                                           float(temperature), chunk_rows(v_local, chunk_size), return_entropy)
    zero = lp.new_zeros(b, 1)
    lp = torch.cat([zero, lp.view(b, length)[:, :-1]], dim=1)
    if not return_entropy:
        return lp, None
    return lp, torch.cat([zero, ent.view(b, length)[:, :-1]], dim=1)


def vocab_sharded(logits: Any) -> tuple[torch.Tensor, int, Any] | None:
    """(local logits, vocabulary offset, process group) when `logits` is a DTensor sharded on its
    last dimension over a 1-D mesh (the tensor-parallel `lm_head`'s output); else None."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # torch < 2.5
        return None
    if not isinstance(logits, DTensor) or logits.device_mesh.ndim != 1:
        return None
    (placement,) = logits.placements
    if not (isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)):
        return None
    vocab, size = logits.shape[-1], logits.device_mesh.size()
    if vocab % size:
        raise ValueError(f"vocabulary {vocab} is not divisible by the tensor-parallel size {size}")
    local = logits.to_local()
    return local, logits.device_mesh.get_local_rank() * local.shape[-1], logits.device_mesh.get_group()
