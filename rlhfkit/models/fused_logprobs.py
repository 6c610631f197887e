"""Fused output projection + log-softmax: token log-probs without materialising `[N, V]` logits.

For a causal LM with a bias-free `lm_head` (weight `W [V, H]`), the log-prob of target y_n is

    z_n = W h_n / T,    logp_n = z_n[y_n] - logsumexp(z_n),    H_n = -sum_v p_nv log p_nv

and with S_nv = 1[v = y_n] - p_nv (the softmax's gradient, independent of the loss) the backward is

    dL/dz_nv = (g_n S_nv - g^H_n p_nv (log p_nv + H_n)) / T
    dL/dh_n  = (dL/dz_n) W,      dL/dW = sum_n (dL/dz_n)^T h_n

When only the log-probs reach the loss (g^H = 0), the per-row factor g_n / T moves out of the GEMMs:
dL/dh = diag(g/T) (S W) and dL/dW = S^T (diag(g/T) h), so the backward is two GEMMs on S and no
pass over `[N, V]` at all. The row kernel that computes log-sum-exp, log-prob and entropy from a
block of logits therefore also writes S over the logits, in place, in its second pass.

Memory: when the whole `[N, V]` block fits in `keep_budget()` (half the memory the caching allocator
could still hand out), the forward's one GEMM writes all logits, the row kernel turns them into S and
the backward uses S as it is: one head GEMM fewer than recomputing. Otherwise rows are processed in
chunks of `CHUNK_BYTES`, the forward keeps only the hidden states, `lse [N]` and the entropy, and the
backward recomputes each chunk's logits and S (the same idea as Liger's fused linear cross-entropy,
written here for log-probs and entropy).

The row kernel is one Triton program per row on CUDA (`rlhfkit/models/head_kernels.py`: online
log-sum-exp in one read, S and the entropy in a second); elsewhere the same in eager PyTorch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from rlhfkit.config.notes import note_once
from rlhfkit.models import head_kernels

CHUNK_BYTES = 1 << 30  # bytes of one chunk of logits in the compute dtype (the recompute path)
KEEP_LOGITS_BYTES: int | None = None  # None: keep_budget(); an int: a fixed budget (0: always recompute)
KEEP_FRACTION = 0.5  # auto budget: this share of the memory the allocator could still hand out
USE_TRITON = True  # the Triton row kernel on CUDA (bench/train_throughput.py's _eagerloss turns it off)


def keep_budget(device: torch.device) -> int:
    """Bytes of logits the forward may keep for the backward on `device`."""
    if KEEP_LOGITS_BYTES is not None:
        return KEEP_LOGITS_BYTES
    if device.type != "cuda":
        return 0  # host memory: the recompute costs the same GEMM either way there
    free, _ = torch.cuda.mem_get_info(device)
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(KEEP_FRACTION * (free + idle))


def _row_stats(z: torch.Tensor, targets: torch.Tensor, inv_t: float, with_entropy: bool, write_s: bool,
               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-prob of the targets, log-sum-exp, entropy) of a block of logits `z [n, V]`; with `write_s`
    z is overwritten with S = onehot(targets) - softmax(z / T), or with g S / T given `scale` = g [n], in its
    own dtype."""
    global USE_TRITON
    if USE_TRITON and head_kernels.available(z):
        try:
            return head_kernels.row_stats(z, targets, inv_t, with_entropy, write_s, scale)
        except Exception as e:  # noqa: BLE001 - a Triton that cannot build for this GPU: the same in PyTorch
            USE_TRITON = False
            note_once(f"note: the fused log-prob head's Triton kernel failed ({type(e).__name__}: "
                      f"{str(e)[:200]}); using its PyTorch version (slower, same results)")
    return head_kernels.row_stats_eager(z, targets, inv_t, with_entropy, write_s, scale)


class FusedLinearLogprobFn(torch.autograd.Function):
    """Head GEMM + row kernel (module docstring): keeps S when it fits, else recomputes by chunks."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an output the loss does not use gets no (zero) gradient pass
        n = hidden.shape[0]
        w = weight.to(hidden.dtype)
        inv_t = 1.0 / temperature
        nbytes = n * weight.shape[0] * hidden.element_size()
        # `backward`: a graph is being recorded (ctx.needs_input_grad says True for a parameter under no_grad too)
        keep = backward and 0 < nbytes <= keep_budget(hidden.device)
        if keep:  # one GEMM for all rows; S stays for the backward
            try:
                s_all = hidden @ w.t()
            except torch.cuda.OutOfMemoryError:  # the estimate was wrong: by chunks after all
                keep = False
        if keep:
            lp, lse, ent = _row_stats(s_all, targets, inv_t, with_entropy, write_s=True)
        else:
            s_all = hidden.new_empty(0, weight.shape[0])
            lp = hidden.new_empty(n, dtype=torch.float32)
            lse = hidden.new_empty(n, dtype=torch.float32)
            ent = hidden.new_zeros(n if with_entropy else 0, dtype=torch.float32)
            for s in range(0, n, chunk):
                lp_c, lse_c, ent_c = _row_stats(hidden[s:s + chunk] @ w.t(), targets[s:s + chunk], inv_t,
                                                with_entropy, write_s=False)
                lp[s:s + chunk], lse[s:s + chunk] = lp_c, lse_c
                if with_entropy:
                    ent[s:s + chunk] = ent_c
        if ent is None:
            ent = hidden.new_zeros(0, dtype=torch.float32)
        ctx.keep, ctx.inv_t, ctx.chunk, ctx.with_entropy = keep, inv_t, chunk, with_entropy
        ctx.save_for_backward(hidden, weight, targets, ent, s_all)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, ent, s_all = ctx.saved_tensors
        w = weight.to(hidden.dtype)
        inv_t = ctx.inv_t
        use_ent = ctx.with_entropy and g_ent is not None  # an entropy used only as a metric adds no term
        g_lp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device) if g_lp is None \
            else g_lp.float()
        grad_h = torch.empty_like(hidden)
        if ctx.keep and not use_ent and hidden.is_cuda and weight.dtype == hidden.dtype:
            # one chunk on the GPU: the weight's gradient straight out of one GEMM (fp32 sums inside,
            # rounded once, as the fp32 buffer below would be), no fp32 buffer to zero, fill and cast
            grad_h.copy_((s_all @ w).float() * (g_lp * inv_t)[:, None])
            hs = (hidden.float() * (g_lp * inv_t)[:, None]).to(hidden.dtype)
            return grad_h, s_all.t() @ hs, None, None, None, None, None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], s_all.shape[0] if ctx.keep else ctx.chunk):
            sl = slice(s, s + (s_all.shape[0] if ctx.keep else ctx.chunk))
            h = hidden[sl]
            scale = g_lp[sl] * inv_t
            if ctx.keep and not use_ent:  # S from the forward: the row factor applied outside the GEMMs
                grad_h[sl] = ((s_all @ w).float() * scale[:, None]).to(hidden.dtype)
                accumulate_outer(grad_w, s_all, (h.float() * scale[:, None]).to(hidden.dtype))
                continue
            if use_ent:  # the entropy term is not a row scaling of S: one element-wise pass
                s_blk = s_all if ctx.keep else h @ w.t()
                if not ctx.keep:
                    _row_stats(s_blk, targets[sl], inv_t, False, write_s=True)
                gz = head_kernels.grad_with_entropy(s_blk, targets[sl], ent[sl], g_lp[sl], g_ent[sl].float(), inv_t)
            else:  # recomputed: the row kernel writes dL/dz = g S / T straight away
                gz = h @ w.t()
                _row_stats(gz, targets[sl], inv_t, False, write_s=True, scale=g_lp[sl])
            grad_h[sl] = gz @ w
            accumulate_outer(grad_w, gz, h)
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def accumulate_outer(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a^T b. On CUDA with bf16/fp16 inputs the GEMM writes fp32 straight into `acc`
    (no low-precision partial, no extra pass); elsewhere through an fp32 temporary."""
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _OUT_DTYPE_MM:
        try:
            torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _disable_out_dtype_mm()
    acc += (a.t() @ b).float()


_OUT_DTYPE_MM = True


def _disable_out_dtype_mm() -> None:
    global _OUT_DTYPE_MM
    _OUT_DTYPE_MM = False


def fusable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's `lm_head` when the fused path applies: a plain bias-free Linear, not sharded, and
    nothing after it (a final logit soft-cap, Gemma 2's, acts on the logits the fused path never makes)."""
    head = model._modules.get("lm_head")  # a direct child (not through a wrapper's __getattr__)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
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
    chunk = chunk_size or max(1, CHUNK_BYTES // (hidden.element_size() * vocab))
    targets = torch.roll(input_ids, shifts=-1, dims=1).reshape(-1)
    backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lp, ent = FusedLinearLogprobFn.apply(hidden.reshape(b * length, hdim), weight, targets, float(temperature),
                                         chunk, return_entropy, backward)
    zero = lp.new_zeros(b, 1)
    lp = torch.cat([zero, lp.view(b, length)[:, :-1]], dim=1)
    if not return_entropy:
        return lp, None
    return lp, torch.cat([zero, ent.view(b, length)[:, :-1]], dim=1)
