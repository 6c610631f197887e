"""AdamW over fp32 master weights in one pass per step (one process, CUDA, Triton).

Per parameter, the one-process master-weights step (master.py) moved through HBM:

    backward hook: bf16 gradient -> fp32 master gradient     read 2 B, write 4 B
    gradient norm over the fp32 gradients                     read 4 B
    torch's fused AdamW                                        read 16 B, write 12 B
    weight check, max |w| per tensor (guard.py)                read 4 B
    the masters rounded into the bf16 module                   read 4 B, write 2 B     = 48 B

With `MasterAdamW`:

    backward hook keeps the bf16 gradient (a second micro-batch sums both into an fp32 master
    gradient, as before: the first is upcast, the second added in fp32)
    gradient norm over the kept gradients, fp32 sums          read 2 B
    one kernel: clip, skip, AdamW, the bf16 copy and a non-finite flag of the new weights
                                                               read 14 B, write 14 B   = 30 B
    (with --max_weight_growth on, the default: max |w| per tensor, guard.py   read 4 B   = 34 B)

and some 600 fewer kernel launches (one launch per parameter group covers every tensor: a table of
pointers, one row per tensor, and a table of (tensor, block) per program).

The update is torch's fused AdamW's, element by element, in fp32:

    g = grad / grad_scale                          (clipping folded in, optim_step.py)
    w = w - lr * wd * w
    m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
    w = w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

with t the parameter's step count after this step; the bias corrections are taken in fp64, as torch
takes them. A non-zero `found_inf` leaves weights, moments and step counts unchanged (torch's fused
AdamW's contract, which `optim_step.masked_step` relies on). The state (`step`, `exp_avg`,
`exp_avg_sq` per master) is torch's AdamW's, so checkpoints and `state_dict` are unchanged.

Where the kernel does not apply (no Triton, not CUDA, amsgrad, maximize, a tensor learning rate,
non-contiguous tensors) the step is torch's AdamW after the kept gradients are upcast, and the
backend rounds the masters into the module as before. `fused_step_eager` is the kernel's update in
PyTorch, the reference of the tests.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None
    tl = None

log = logging.getLogger(__name__)

USE_KERNEL = True  # False: torch's AdamW + the separate copy into the module (benchmarks' A/B)
BLOCK = 4096  # elements per program
WARPS = 8


class MasterAdamW(torch.optim.AdamW):
    """torch's AdamW over the fp32 masters of `master` (a `MasterWeights`), whose step on CUDA is one
    Triton kernel per parameter group that also writes the bf16 module (see the module docstring).

    After a step, `wrote_module` says whether the module already holds the rounded masters, and
    `weights_bad` is a device flag (non-zero: a weight this step wrote is NaN or infinite), or None."""

    _step_supports_amp_scaling = True  # reads found_inf / grad_scale, as torch's fused AdamW does

    def __init__(self, params: Any, master: Any, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.master = master
        self.wrote_module = False
        self.weights_bad: torch.Tensor | None = None
        self._blocks: dict[tuple[int, ...], torch.Tensor] = {}
        self._kernel_failed = False

    # ------------------------------------------------------------------ which path

    def kernel_usable(self) -> bool:
        """Whether steps run the Triton kernel (the master then keeps bf16 gradients)."""
        if triton is None or self._kernel_failed or not USE_KERNEL:
            return False
        for g in self.param_groups:
            if g.get("amsgrad") or g.get("maximize") or g.get("differentiable") or isinstance(g["lr"], torch.Tensor):
                return False
            if any(not (m.is_cuda and m.dtype == torch.float32 and m.is_contiguous()) for m in g["params"]):
                return False
        return all(p.is_contiguous() and p.dtype in (torch.bfloat16, torch.float16) for p in self.master.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.master.clear_low_grads()

    def grads_pending(self) -> bool:
        return self.master.has_low_grads()

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.wrote_module, self.weights_bad = False, None
        if closure is not None or not self.kernel_usable():
            self.master.materialize_grads()
            return super().step(closure)
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        launches = self._launches()
        if not launches:
            return None
        device = launches[0][1][0][1].device
        bad = torch.zeros(1, dtype=torch.int32, device=device)
        steps = [self.state[m]["step"] for _, rows in launches for _, m, _ in rows]
        torch._foreach_add_(steps, 1.0)
        try:
            for group, rows in launches:
                self._launch(group, rows, found_inf, grad_scale, bad)
        except Exception as e:  # a kernel that does not build here: torch's AdamW from now on
            torch._foreach_sub_(steps, 1.0)
            self._kernel_failed = True
            self.master.keep_low_grads = False
            log.warning("note: the fused master-weight AdamW kernel failed (%s: %s); using torch's AdamW",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.master.materialize_grads()
            return super().step()
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf.to(steps[0].dtype)] * len(steps))
        self.wrote_module, self.weights_bad = True, bad.reshape(())
        return None

    def _launches(self) -> list[tuple[dict, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]]:
        """Per (group, gradient dtype): rows of (gradient, master, module parameter) for the masters
        that have a gradient this step; their state is created on first use, as torch does."""
        low_of = self.master.low_param_of
        grads = self.master.current_grads()
        out = []
        for group in self.param_groups:
            by_dtype: dict[torch.dtype, list] = {}
            for m in group["params"]:
                g = grads.get(id(m))
                if g is None:
                    continue
                st = self.state[m]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=m.device)
                    st["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                elif st["step"].device != m.device or st["step"].dtype != torch.float32:
                    # loaded from a checkpoint whose optimizer kept it on the host (the kernel reads it
                    # on the device, as torch's fused AdamW does); the moments load as the masters are
                    st["step"] = st["step"].to(m.device, torch.float32)
                by_dtype.setdefault(g.dtype, []).append((g.contiguous(), m, low_of(m)))
            out.extend((group, rows) for rows in by_dtype.values())
        return out

    def _launch(self, group: dict, rows: list, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None,
                bad: torch.Tensor) -> None:
        """One kernel over `rows`. The table holds element offsets from the first row's tensors (one
        base per dtype, which Triton knows to be aligned), so that the kernel's loads are vectorized
        where every tensor is 16-byte aligned (the caching allocator's tensors are)."""
        device = rows[0][1].device
        g0, w0, l0 = rows[0]
        # columns: gradient, master, exp_avg, exp_avg_sq, module parameter, step (element offsets), numel
        table, aligned = [], True
        for g, m, low in rows:
            st = self.state[m]
            fp32 = (m, st["exp_avg"], st["exp_avg_sq"])
            aligned = aligned and all(t.data_ptr() % 16 == 0 for t in (g, low, *fp32))
            table.append([(g.data_ptr() - g0.data_ptr()) // g.element_size(),
                          *((t.data_ptr() - w0.data_ptr()) // 4 for t in fp32),
                          (low.data_ptr() - l0.data_ptr()) // low.element_size(),
                          (st["step"].data_ptr() - w0.data_ptr()) // 4, m.numel()])
        offsets = _to(torch.tensor(table, dtype=torch.int64), device)
        blocks = self._block_table(tuple(m.numel() for _, m, _ in rows), device)
        beta1, beta2 = group["betas"]
        logs = _to(torch.tensor([math.log(beta1) if beta1 > 0 else -math.inf,
                                 math.log(beta2) if beta2 > 0 else -math.inf], dtype=torch.float64), device)
        skip = found_inf if found_inf is not None else bad  # `bad` is zero here: nothing skipped
        scale = grad_scale if grad_scale is not None else bad
        _adamw_kernel[(blocks.shape[0],)](
            offsets, blocks, logs, skip, scale, bad, g0, w0, l0,
            float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            HAS_SCALE=grad_scale is not None, ALIGNED=aligned, BLOCK=BLOCK, num_warps=WARPS)

    def _block_table(self, numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """[programs, 2] int32: (row of the pointer table, block index within that tensor); cached."""
        got = self._blocks.get(numels)
        if got is None:
            counts = torch.tensor([-(-n // BLOCK) for n in numels])
            rows = torch.repeat_interleave(torch.arange(len(numels)), counts)
            first = torch.cumsum(counts, 0) - counts
            within = torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)
            got = torch.stack([rows, within], 1).to(torch.int32).to(device)
            self._blocks[numels] = got
        return got


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor onto `device` without a host sync (through pinned memory on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


if triton is not None:

    @triton.jit
    def _adamw_kernel(table, blocks, logs, skip_ptr, scale_ptr, bad_ptr, g_base, w_base, low_base,
                      lr, beta1, beta2, eps, wd, HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        row = tl.load(blocks + 2 * pid).to(tl.int64)
        start = tl.load(blocks + 2 * pid + 1).to(tl.int64) * BLOCK
        r = table + row * 7
        og, ow, om, ov = tl.load(r), tl.load(r + 1), tl.load(r + 2), tl.load(r + 3)
        ol, ostep, numel = tl.load(r + 4), tl.load(r + 5), tl.load(r + 6)
        if ALIGNED:  # 16 bytes: 4 fp32 or 8 bf16 elements
            og = tl.multiple_of(og, 16 // g_base.dtype.element_ty.primitive_bitwidth * 8)
            ow, om, ov = tl.multiple_of(ow, 4), tl.multiple_of(om, 4), tl.multiple_of(ov, 4)
            ol = tl.multiple_of(ol, 16 // low_base.dtype.element_ty.primitive_bitwidth * 8)
        numel = tl.where(tl.load(skip_ptr).to(tl.float32) == 0.0, numel, 0)  # a skipped step touches nothing
        # bias corrections in fp64 from this tensor's step count (already incremented)
        t = tl.load(w_base + ostep).to(tl.float64)
        bc1 = (1.0 - tl.exp(t * tl.load(logs))).to(tl.float32)
        bc2_sqrt = tl.sqrt((1.0 - tl.exp(t * tl.load(logs + 1))).to(tl.float32))
        scale = 1.0
        if HAS_SCALE:
            scale = tl.load(scale_ptr).to(tl.float32)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:  # a whole block: no mask, so that loads and stores are vectorized
            bad = _adamw_block(g_base + og + offs, w_base + ow + offs, w_base + om + offs, w_base + ov + offs,
                               low_base + ol + offs, offs < numel, scale, lr, beta1, beta2, eps, wd, bc1,
                               bc2_sqrt, HAS_SCALE, False)
        else:
            bad = _adamw_block(g_base + og + offs, w_base + ow + offs, w_base + om + offs, w_base + ov + offs,
                               low_base + ol + offs, offs < numel, scale, lr, beta1, beta2, eps, wd, bc1,
                               bc2_sqrt, HAS_SCALE, True)
        tl.store(bad_ptr, bad, mask=bad > 0)

    @triton.jit
    def _adamw_block(g_ptrs, w_ptrs, m_ptrs, v_ptrs, low_ptrs, mask, scale, lr, beta1, beta2, eps, wd, bc1,
                     bc2_sqrt, HAS_SCALE: tl.constexpr, MASKED: tl.constexpr):
        if MASKED:
            g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=mask, other=0.0)
            m = tl.load(m_ptrs, mask=mask, other=0.0)
            v = tl.load(v_ptrs, mask=mask, other=0.0)
        else:
            g = tl.load(g_ptrs).to(tl.float32)
            w = tl.load(w_ptrs)
            m = tl.load(m_ptrs)
            v = tl.load(v_ptrs)
        if HAS_SCALE:
            g = g / scale  # as torch's fused AdamW unscales
        w = w - lr * wd * w
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        step_size = lr / bc1
        denom = tl.sqrt(v) / bc2_sqrt + eps
        w = w - step_size * m / denom
        low = w.to(low_ptrs.dtype.element_ty, fp_downcast_rounding="rtne")  # as Tensor.copy_
        nonfinite = (w != w) | (tl.abs(w) == float("inf"))
        if MASKED:
            tl.store(w_ptrs, w, mask=mask)
            tl.store(m_ptrs, m, mask=mask)
            tl.store(v_ptrs, v, mask=mask)
            tl.store(low_ptrs, low, mask=mask)
            nonfinite = nonfinite & mask
        else:
            tl.store(w_ptrs, w)
            tl.store(m_ptrs, m)
            tl.store(v_ptrs, v)
            tl.store(low_ptrs, low)
        return tl.max(nonfinite.to(tl.int32), axis=0)


@torch.no_grad()
def fused_step_eager(grad: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, low: torch.Tensor,
                     step: torch.Tensor, lr: float, betas: tuple[float, float], eps: float, wd: float,
                     grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> bool:
    """The kernel's update of one tensor in PyTorch (the tests' reference): `step` is incremented here
    unless `found_inf`; returns whether the new weights are all finite."""
    if found_inf is not None and float(found_inf) != 0.0:
        return True
    step += 1
    beta1, beta2 = betas
    t = float(step)
    bc1 = 1.0 - beta1 ** t
    bc2_sqrt = math.sqrt(1.0 - beta2 ** t)
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale.float()
    w.sub_(lr * wd * w)
    m.mul_(beta1).add_((1.0 - beta1) * g)
    v.mul_(beta2).add_((1.0 - beta2) * g * g)
    w.sub_((lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps))
    low.copy_(w)
    return bool(torch.isfinite(w).all())
