"""Triton GEMMs for the decode step's small-M projections (one token per row, M = batch rows).

cuBLAS picks tiles for these shapes that leave most of the GPU idle: few programs that each walk
all of K (a memory-bound GEMM far below the HBM bandwidth), or tiles that overfill M and spill into
a second wave (bench/gemm_decode.py measures both). Two ops replace them in the decode layer:

`rlhfkit::mm_partials(a [M, K], w [N, K]) -> [S, M, N] fp32`
    a @ w.T split over K into S slices (split-K): program (m, n, s) sums its slice of K into an
    fp32 tile and stores it at partial s. The S partials are summed by the consumer, which
    torch.compile fuses into the residual add and RMSNorm that follow (inductor unrolls a sum over
    a small static dim into pointwise loads), so split-K costs no extra kernel. S depends on the
    weight shape only (`splits_for`), so the op's output shape is known when the batch is symbolic.
    No atomics: the result is deterministic.

`rlhfkit::gate_up_silu(a [M, K], w [2I, K]) -> [M, I] (a's dtype)`
    silu(a @ w[:I].T) * (a @ w[I:].T) with the gate and up tiles of the same columns computed by
    one program (two accumulators), so the [M, 2I] intermediate never reaches memory. Both GEMM
    results are rounded to the model dtype before the epilogue, as the unfused GEMMs' outputs are.

`rlhfkit::residual_rmsnorm(x [M, H], partials [S, M, H] fp32, weight [H], eps) -> (x', h)`
    The consumer of the o / down partials: x' = x + sum(partials) (the sum rounded to x's dtype
    first, as a GEMM's output is) and h = RMSNorm(x') as Hugging Face computes it, one row per
    program. It replaces the kernel torch.compile generated for the same expression so that this
    boundary too takes part in programmatic dependent launch (the norm weight is read before the wait).

Launch parameters come from `gemm_config` / `gate_up_config` (chosen with bench/gemm_decode.py)
and can be overridden through `GEMM_CONFIG` for sweeps. Both kernels take
part in programmatic dependent launch (`triton_launch.use_pdl`): they wait for the kernel before them
only when they need its output, the activations. The weight tiles are not prefetched into L2
before that wait: the prefetches would compete with the kernel before.
"""

from __future__ import annotations

import torch

from rlhfkit.rollout.builtin.kernels.triton_launch import pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

# overrides of the launch parameters (None = the measured defaults); keys: "mm" and "gate_up", each a
# dict of block_m, block_n, block_k, num_warps, num_stages (and "splits" for mm, used by `splits_for`)
GEMM_CONFIG: dict[str, dict] = {"mm": {}, "gate_up": {}}


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def splits_for(n: int, k: int) -> int:
    """Split-K factor for a weight `[N, K]`: enough (n-tile, split) programs to fill the GPU at
    64-column tiles, each slice a multiple of 64 long. A function of the weight alone, so that the
    partials' shape does not depend on the (possibly symbolic) number of rows."""
    forced = GEMM_CONFIG["mm"].get("splits")
    if forced:
        return forced if k % (forced * 32) == 0 else 1
    tiles = -(-n // 64)
    best = 1
    for s in (2, 3, 4, 6, 8):
        if k % (s * 64) == 0 and tiles * best < 128 and k // s >= 256:
            best = s
    return best


def gemm_config(m: int, n: int, k: int, splits: int) -> dict:
    """64 x 32 tiles at M <= 64, 64 x 64 above: the fastest for Qwen2-0.5B's o and down projections in
    bench/results/gemm_decode_h100.json, where both beat cuBLAS."""
    cfg = {"block_m": 64, "block_n": 32 if m <= 64 else 64, "block_k": 64, "num_warps": 4, "num_stages": 4}
    if (k // splits) % cfg["block_k"]:
        cfg["block_k"] = 32
    cfg.update({key: val for key, val in GEMM_CONFIG["mm"].items() if key != "splits" and val})
    return cfg


def gate_up_config(m: int, inter: int, k: int) -> dict:
    """H100, K = 896, I = 4864: M = 64 9.7 us, M = 256 13.1 us, against cuBLAS + the compiled SiLU-mul's
    10.9 and 14.6 us."""
    small = m <= 64
    cfg = {"block_m": 64, "block_n": 64, "block_k": 128 if small and k % 128 == 0 else 64, "num_warps": 4,
           "num_stages": 4 if small else 3}
    cfg.update({key: val for key, val in GEMM_CONFIG["gate_up"].items() if val})
    return cfg


SMEM_BUDGET = 200 * 1024  # bytes of shared memory a program may take (H100: 227 KB)


def _fit_smem(cfg: dict, elem: int, weight_tiles: int) -> dict:
    """Fewer stages, then a shorter K tile, until the pipelined tiles fit (fp32 inputs need 2x the bf16 room)."""
    def need(c: dict) -> int:
        return c["num_stages"] * (c["block_m"] + weight_tiles * c["block_n"]) * c["block_k"] * elem

    while need(cfg) > SMEM_BUDGET and cfg["num_stages"] > 2:
        cfg["num_stages"] -= 1
    while need(cfg) > SMEM_BUDGET and cfg["block_k"] > 32:
        cfg["block_k"] //= 2
    return cfg


def supported(n: int, k: int) -> bool:
    return k % 32 == 0 and n >= 16


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _mm_partials_kernel(A, W, C, M, N, sam, swn, scs, scm, K_PER_SPLIT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PREC: tl.constexpr, PDL: tl.constexpr):
        pid_m = tl.program_id(0)  # fastest: the programs reading one weight tile run together (L2)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < N
        k0 = pid_s * K_PER_SPLIT
        if PDL:  # the activations come from the kernel before
            gdc_wait()
        a_ptr = A + offs_m[:, None] * sam + (k0 + offs_k)[None, :]
        w_ptr = W + offs_n[:, None] * swn + (k0 + offs_k)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(K_PER_SPLIT // BLOCK_K):
            a = tl.load(a_ptr, mask=mmask[:, None], other=0.0)
            w = tl.load(w_ptr, mask=nmask[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K
        if PDL:
            gdc_launch_dependents()
        tl.store(C + pid_s * scs + offs_m[:, None] * scm + offs_n[None, :], acc,
                 mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _gate_up_silu_kernel(A, W, Out, M, INTER, K: tl.constexpr, sam, swn, som,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PREC: tl.constexpr, PDL: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < INTER
        if PDL:  # the activations come from the kernel before
            gdc_wait()
        a_ptr = A + offs_m[:, None] * sam + offs_k[None, :]
        g_ptr = W + offs_n[:, None] * swn + offs_k[None, :]
        u_ptr = g_ptr + INTER * swn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(K // BLOCK_K):
            a = tl.load(a_ptr, mask=mmask[:, None], other=0.0)
            wg = tl.load(g_ptr, mask=nmask[:, None], other=0.0)
            wu = tl.load(u_ptr, mask=nmask[:, None], other=0.0)
            acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=PREC)
            acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=PREC)
            a_ptr += BLOCK_K
            g_ptr += BLOCK_K
            u_ptr += BLOCK_K
        if PDL:
            gdc_launch_dependents()
        dt = Out.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)  # the unfused GEMMs' outputs are rounded to the model dtype
        u = acc_u.to(dt).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(Out + offs_m[:, None] * som + offs_n[None, :], out.to(dt), mask=mmask[:, None] & nmask[None, :])


if triton is not None:

    @triton.jit
    def _residual_rmsnorm_kernel(X, P, Wt, XO, HO, H, sx, sps, spm, sxo, sho, eps, S: tl.constexpr,
                                 BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        w = tl.load(Wt + offs, mask=mask, other=0.0).to(tl.float32)
        if PDL:  # the partials come from the kernel before
            gdc_wait()
        d = tl.load(P + row * spm + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, S):
            d += tl.load(P + s * sps + row * spm + offs, mask=mask, other=0.0)
        dt = XO.dtype.element_ty
        x = tl.load(X + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
        xn = (x + d.to(dt).to(tl.float32)).to(dt)
        tl.store(XO + row * sxo + offs, xn, mask=mask)
        xf = xn.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(xf * xf, 0) / H + eps)
        h = (w * (xf * r).to(dt).to(tl.float32)).to(dt)
        if PDL:
            gdc_launch_dependents()
        tl.store(HO + row * sho + offs, h, mask=mask)


@torch.library.custom_op("rlhfkit::residual_rmsnorm", mutates_args=())
def residual_rmsnorm(x: torch.Tensor, partials: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`x' = x + partials.sum(0).to(x.dtype)` and `h = weight * (x' * rsqrt(mean(x'^2) + eps)).to(x.dtype)`
    (in fp32) for `x [M, H]`, split-K partials `[S, M, H]` fp32 and the norm weight `[H]`."""
    if triton is None:
        raise RuntimeError("rlhfkit::residual_rmsnorm needs Triton")
    m, hdim = x.shape
    if partials.dim() != 3 or partials.shape[1:] != x.shape or partials.dtype != torch.float32:
        raise ValueError(f"residual_rmsnorm: partials [S, {m}, {hdim}] fp32 expected, got {tuple(partials.shape)}")
    if x.stride(1) != 1 or partials.stride(2) != 1 or weight.stride(0) != 1:
        raise ValueError("residual_rmsnorm: unit stride along H expected")
    x_new, h = torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(x, memory_format=torch.contiguous_format)
    if m == 0:
        return x_new, h
    _residual_rmsnorm_kernel[(m,)](x, partials, weight, x_new, h, hdim, x.stride(0), partials.stride(0),
                                   partials.stride(1), x_new.stride(0), h.stride(0), eps, S=partials.shape[0],
                                   BLOCK=triton.next_power_of_2(hdim), num_warps=4, **pdl_launch(x.device))
    return x_new, h


@residual_rmsnorm.register_fake
def _residual_rmsnorm_fake(x, partials, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(x, memory_format=torch.contiguous_format)


def _prec(a: torch.Tensor) -> str:
    """fp32 inputs multiply in full precision (TF32 only when torch allows it), as F.linear does."""
    return "tf32" if a.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _check(a: torch.Tensor, w: torch.Tensor, name: str) -> None:
    if triton is None:
        raise RuntimeError(f"rlhfkit::{name} needs Triton")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: a [M, K] and w [N, K] expected, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{name}: a and w need a unit stride along K")


@torch.library.custom_op("rlhfkit::mm_partials", mutates_args=())
def mm_partials(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Split-K partial products of `a @ w.T`: `[S, M, N]` fp32 whose sum over dim 0 is the product."""
    _check(a, w, "mm_partials")
    m, k = a.shape
    n = w.shape[0]
    s = splits_for(n, k)
    out = torch.empty((s, m, n), dtype=torch.float32, device=a.device)
    if m == 0:
        return out
    cfg = _fit_smem(gemm_config(m, n, k, s), a.element_size(), 1)
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]), s)
    _mm_partials_kernel[grid](a, w, out, m, n, a.stride(0), w.stride(0), out.stride(0), out.stride(1), K_PER_SPLIT=k // s,
                              BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                              PREC=_prec(a), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                              **pdl_launch(a.device))
    return out


@mm_partials.register_fake
def _mm_partials_fake(a, w):
    return torch.empty((splits_for(w.shape[0], w.shape[1]), a.shape[0], w.shape[0]), dtype=torch.float32,
                       device=a.device)


@torch.library.custom_op("rlhfkit::gate_up_silu", mutates_args=())
def gate_up_silu(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`silu(a @ w[:I].T) * (a @ w[I:].T)` for the fused gate/up weight `w [2I, K]` -> `[M, I]`."""
    _check(a, w, "gate_up_silu")
    m, k = a.shape
    inter = w.shape[0] // 2
    out = torch.empty((m, inter), dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    cfg = _fit_smem(gate_up_config(m, inter, k), a.element_size(), 2)
    if k % cfg["block_k"]:
        raise ValueError(f"gate_up_silu: K={k} is not a multiple of block_k={cfg['block_k']}")
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(inter, cfg["block_n"]))
    _gate_up_silu_kernel[grid](a, w, out, m, inter, k, a.stride(0), w.stride(0), out.stride(0),
                               BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                               PREC=_prec(a), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                               **pdl_launch(a.device))
    return out


@gate_up_silu.register_fake
def _gate_up_silu_fake(a, w):
    return torch.empty((a.shape[0], w.shape[0] // 2), dtype=a.dtype, device=a.device)
