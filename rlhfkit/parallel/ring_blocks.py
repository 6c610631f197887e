"""Block attention for ring attention (parallel/ring_attention.py): the math and the fast CUDA path.

* `merge_attention`, `_block_forward`, `_block_backward`: the online-softmax merge and the masked fp32
  block attention of the math path (any device, any float dtype; float64 stays float64).
* `block_rectangles`: what this rank's queries see of rank src's keys, as rectangles in local indices,
  each FULL (every query sees every key) or CAUSAL (q and k cover the same global positions: the
  lower-triangular square). Each rank holds one (contiguous) or two (zig-zag) runs of consecutive
  global positions; a packed sequence cuts a run in one contiguous range; for ranges of one sequence,
  the same run gives a CAUSAL square, k wholly before q a FULL rectangle, k after q nothing (causal=False:
  FULL for every pair). Padding (past the last boundary) is in no rectangle.
* Kernels with one contract - forward(q [B, Hq, m, D], k/v [B, Hk, n, D], causal, scale) -> out
  [B, Hq, m, D], lse [B, Hq, m] (fp32); backward(dout, q, k, v, out, lse, causal, scale) -> dq
  [B, Hq, m, D], dk/dv [B, Hk, n, D], with out/lse the FINAL (merged) ones, FlashAttention-2's backward
  with the global lse (what ring-flash-attn does). "flash": torch's FlashAttention-2 ops
  (`aten._scaled_dot_product_flash_attention[_backward]`, CUDA, fp16/bf16); "efficient": torch's
  memory-efficient ops; "blocks": the math above (any device; the CPU tests drive the same code with
  it). K/V heads are expanded per rectangle for GQA and dK/dV summed back over the group. A CUDA kernel
  is used only after a small probe on that device, dtype and head size matched the math.
* `forward_rects` / `backward_rects`: one ring pass (one head group) over the rectangles, merging in
  fp32; dK/dV fp32 accumulators travel one step behind K/V as in the math path.
"""

from __future__ import annotations

import itertools

import torch

FULL, CAUSAL = "full", "causal"
KERNELS = ("auto", "math", "blocks", "flash", "efficient")
_KV_TAG, _GRAD_TAG = 17, 18


# ---------------------------------------------------------------------------------------------- math

def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial attentions over disjoint key sets: out [..., S, D], lse [..., S].

    L = log(e^L_a + e^L_b); O = e^(L_a - L) O_a + e^(L_b - L) O_b. A row that saw no key has L = -inf
    and contributes nothing; a row with no key on either side stays (0, -inf)."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    denom = wa + wb
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = (wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b) / safe.unsqueeze(-1)
    return out, m + torch.log(denom)


def _block_forward(q, k, v, mask, scale):
    """q [B, Hk, g, Sq, D], k/v [B, Hk, Sk, D] (fp32), mask [Sq, Sk] bool or None -> out, lse [B, Hk, g, Sq]."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), lse


def _block_backward(q, k, v, dout, lse, delta, mask, scale):
    """FlashAttention-2 backward of one block from the final lse and delta = rowsum(dO * O)
    -> dq [B, Hk, g, Sq, D], dk/dv [B, Hk, Sk, D] (fp32)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)  # a row with no key: P = 0
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    ds = p * (torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- rectangles

def local_runs(local_len: int, rank: int, world: int, layout: str) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the runs of consecutive global positions a rank holds."""
    if layout == "contiguous":
        return [(0, rank * local_len, local_len)]
    c = local_len // 2
    return [(0, rank * c, c), (c, (2 * world - 1 - rank) * c, c)]


def block_rectangles(local_len: int, rank: int, src: int, world: int, layout: str, causal: bool,
                     cu: list[int]) -> list[tuple[slice, slice, str]]:
    """Rank `rank`'s queries against rank `src`'s keys: [(q slice, k slice, FULL | CAUSAL)] in local
    indices, disjoint, whose union is the visible set. `cu`: sequence boundaries in the full row (the
    padded form is one sequence [0, total_len]); positions past cu[-1] are in no rectangle."""
    rects = []
    segs = list(itertools.pairwise(cu))
    for lq, gq, nq in local_runs(local_len, rank, world, layout):
        for lk, gk, nk in local_runs(local_len, src, world, layout):
            if causal and gk > gq:  # distinct runs are disjoint: k wholly after q sees nothing
                continue
            kind = CAUSAL if causal and gk == gq else FULL
            for a, b in segs:
                qa, qb = max(a, gq), min(b, gq + nq)
                ka, kb = max(a, gk), min(b, gk + nk)
                if qa < qb and ka < kb:
                    rects.append((slice(lq + qa - gq, lq + qb - gq), slice(lk + ka - gk, lk + kb - gk), kind))
    return rects


# ---------------------------------------------------------------------------------------------- kernels

def _expand(t: torch.Tensor, g: int) -> torch.Tensor:
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _fold(t: torch.Tensor, g: int) -> torch.Tensor:
    """dK/dV over expanded heads [B, Hq, n, D] -> summed over each group [B, Hk, n, D] (fp32)."""
    t = t.float() if t.dtype != torch.float64 else t
    if g == 1:
        return t
    b, hq, n, d = t.shape
    return t.view(b, hq // g, g, n, d).sum(2)


class MathKernel:
    """The math path's block attention under the rectangle contract (any device)."""

    name = "blocks"

    @staticmethod
    def _setup(q, k, causal):
        acc = torch.promote_types(q.dtype, torch.float32)
        b, hq, m, d = q.shape
        hk, n = k.shape[1], k.shape[2]
        mask = torch.ones(m, n, dtype=torch.bool, device=q.device).tril() if causal else None
        return acc, (b, hk, hq // hk, m, d), mask

    def forward(self, q, k, v, causal, scale):
        acc, shape5, mask = self._setup(q, k, causal)
        out, lse = _block_forward(q.to(acc).reshape(shape5), k.to(acc), v.to(acc), mask, scale)
        return out.reshape(q.shape), lse.reshape(q.shape[:-1])

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        acc, shape5, mask = self._setup(q, k, causal)
        do5 = dout.to(acc).reshape(shape5)
        delta = (do5 * out.to(acc).reshape(shape5)).sum(-1)
        dq, dk, dv = _block_backward(q.to(acc).reshape(shape5), k.to(acc), v.to(acc), do5,
                                     lse.reshape(shape5[:-1]), delta, mask, scale)
        return dq.reshape(q.shape), dk, dv


class FlashKernel:
    """torch's FlashAttention-2 ops (is_causal is top-left aligned: right for the CAUSAL squares)."""

    name = "flash"

    def __init__(self):
        self.rng = None  # philox seed/offset from a forward (unused without dropout, but the op wants them)

    def forward(self, q, k, v, causal, scale):
        g = q.shape[1] // k.shape[1]
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, _expand(k, g), _expand(v, g), 0.0, causal,
                                                                 False, scale=scale)
        if self.rng is None:
            self.rng = (res[6], res[7])
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        g = q.shape[1] // k.shape[1]
        m, n = q.shape[2], k.shape[2]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, _expand(k, g), _expand(v, g), out, lse.contiguous(), None, None, m, n, 0.0, causal,
            self.rng[0], self.rng[1], scale=scale)
        return dq, _fold(dk, g), _fold(dv, g)


class EfficientKernel:
    """torch's memory-efficient attention ops (log-sum-exp rows padded to a multiple of 32)."""

    name = "efficient"

    def __init__(self):
        self.rng = None

    def forward(self, q, k, v, causal, scale):
        g = q.shape[1] // k.shape[1]
        res = torch.ops.aten._scaled_dot_product_efficient_attention(q, _expand(k, g), _expand(v, g), None, True,
                                                                     0.0, causal, scale=scale)
        if self.rng is None:
            self.rng = (res[2], res[3])
        return res[0], res[1][..., :q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        g = q.shape[1] // k.shape[1]
        m = q.shape[2]
        padded = -(-m // 32) * 32
        lse_p = lse.new_zeros((*lse.shape[:-1], padded))
        lse_p[..., :m] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _expand(k, g), _expand(v, g), None, out, lse_p, self.rng[0], self.rng[1], 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq, _fold(dk, g), _fold(dv, g)


_PROBED: dict = {}
PROBE_FAILURES: dict = {}  # (kernel, device, dtype, hq, hk, d) -> why the probe refused it


def _probe(kern, device, dtype, hq, hk, d) -> str | None:
    """Why `kern` does not match the math kernel here (fwd and bwd with a merged lse, FULL and CAUSAL,
    GQA), or None when it does."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    m, n, scale = 80, 48, d ** -0.5

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v, do = rnd(1, hq, m, d), rnd(1, hk, n, d), rnd(1, hk, n, d), rnd(1, hq, m, d)
    kc, vc = rnd(1, hk, m, d), rnd(1, hk, m, d)  # a CAUSAL rectangle is square
    ref = MathKernel()
    try:
        for causal, kk, vv in ((False, k, v), (True, kc, vc)):
            o_ref, l_ref = ref.forward(q, kk, vv, causal, scale)
            o, lse = kern.forward(q, kk, vv, causal, scale)
            err_o, err_l = float((o.float() - o_ref).abs().max()), float((lse.float() - l_ref).abs().max())
            if not (err_o <= 2e-2 and err_l <= 1e-2):  # NaN fails too
                return f"causal={causal}: forward off by {err_o:.3g} (out), {err_l:.3g} (lse)"
            # backward with a "final" lse that also counts other keys (as after a ring merge)
            l_fin = l_ref + 0.5
            o_fin = (o_ref * torch.exp(l_ref - l_fin).unsqueeze(-1)).to(dtype)
            g_ref = ref.backward(do, q, kk, vv, o_fin, l_fin, causal, scale)
            g_got = kern.backward(do, q, kk, vv, o_fin, l_fin.float(), causal, scale)
            for name, a, b in zip(("dq", "dk", "dv"), g_got, g_ref):
                if a.shape != b.shape:
                    return f"causal={causal}: {name} has shape {tuple(a.shape)}, not {tuple(b.shape)}"
                err = float((a.float() - b).abs().max())
                if not err <= 3e-2 * max(1.0, float(b.abs().max())):
                    return f"causal={causal}: backward {name} off by {err:.3g}"
        return None
    except (AttributeError, RuntimeError, NotImplementedError, TypeError, ValueError, IndexError) as exc:
        # a missing op (AttributeError), an unsupported shape or arch (RuntimeError): refuse the kernel
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def pick_kernel(kernel: str, device: torch.device, dtype: torch.dtype, hq: int, hk: int, d: int):
    """The kernel object for `kernel` (KERNELS), or None for the math path. "auto": flash, else efficient
    on CUDA with fp16/bf16 inputs where the probe passes, else the math path."""
    if kernel not in KERNELS:
        raise ValueError(f"ring attention kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "math":
        return None
    if kernel == "blocks":
        return MathKernel()
    fast_ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    names = ("flash", "efficient") if kernel == "auto" else (kernel,)
    for name in names:
        if not fast_ok:
            break
        key = (name, str(device), dtype, hq, hk, d)
        if key not in _PROBED:
            kern = FlashKernel() if name == "flash" else EfficientKernel()
            why = _probe(kern, device, dtype, hq, hk, d)
            _PROBED[key] = kern if why is None else None
            if why is not None:
                PROBE_FAILURES[key] = why
        if _PROBED[key] is not None:
            return _PROBED[key]
    if kernel == "auto":
        return None
    why = PROBE_FAILURES.get((kernel, str(device), dtype, hq, hk, d), "needs CUDA and fp16/bf16 inputs")
    raise ValueError(f"ring attention kernel {kernel!r} is not usable here ({device.type}, {dtype}, "
                     f"head_dim {d}: {why}); use kernel='auto' or 'math'")


# ---------------------------------------------------------------------------------------------- ring passes

def _wait(pending):
    recv, works = pending
    for w in works:
        w.wait()
    return recv


def forward_rects(ring, kern, q, k, v, rects):
    """One ring pass for one head group: q [B, Hq', S, D], k/v [B, Hk', S, D] (input dtype), rects[src]
    -> out fp32 [B, Hq', S, D], lse fp32 [B, Hq', S]."""
    acc = ring.acc
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    for j in range(ring.world):
        src = (ring.rank - j) % ring.world
        pending = ring.exchange(kv, _KV_TAG) if j < ring.world - 1 else None
        for qs, ks, kind in rects[src]:
            o_b, l_b = kern.forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], kind == CAUSAL, ring.scale)
            out[:, :, qs], lse[:, :, qs] = merge_attention(out[:, :, qs], lse[:, :, qs], o_b.to(acc), l_b.to(acc))
        if pending is not None:
            kv = _wait(pending)
    return out, lse


def backward_rects(ring, kern, q, k, v, dout, out, lse, rects):
    """One backward ring pass for one head group (out in the input dtype, lse fp32: the final ones)
    -> dq, dk, dv (fp32)."""
    acc = ring.acc
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    acc_pending = None
    grads = None
    for j in range(ring.world):
        src = (ring.rank - j) % ring.world
        pending = ring.exchange(kv, _KV_TAG) if j < ring.world - 1 else None
        contrib = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        for qs, ks, kind in rects[src]:
            dq_b, dk_b, dv_b = kern.backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                             out[:, :, qs], lse[:, :, qs], kind == CAUSAL, ring.scale)
            dq[:, :, qs] += dq_b
            contrib[0][:, :, ks] += dk_b
            contrib[1][:, :, ks] += dv_b
        if acc_pending is not None:  # the accumulator of block src, one step behind on the ring
            contrib += _wait(acc_pending)
        grads = contrib
        if ring.world > 1:
            acc_pending = ring.exchange(grads, _GRAD_TAG)
        if pending is not None:
            kv = _wait(pending)
    if acc_pending is not None:  # after N steps the previous rank hands over this rank's own block
        grads = _wait(acc_pending)
    return dq, grads[0], grads[1]
