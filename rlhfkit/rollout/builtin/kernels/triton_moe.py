"""Triton kernels for the routed experts of a decode step (Qwen3-MoE, gpt-oss), as torch custom ops.

In a decode step each expert gets a handful of the batch's T x k (token, choice) rows, so the expert
GEMMs are bound by reading the expert weights. The two ops read each expert's weight tile once per
program and loop over that expert's rows (grouped by expert beforehand, `experts.dispatch`):

`rlhfkit::moe_gate_up(x [T, H], perm [S], offsets [E], w [E, 2I, H], bias [E, 2I] | None, top_k, act,
alpha, limit) -> [S, I]`
    Program (m, n) takes block m of the grouped rows (at most BLOCK_M rows of one expert e: an expert
    with more rows has more blocks, so no program waits on a crowded expert), gathers them from `x`
    (row r of the grouped order is token `perm[r] // top_k`), multiplies them by the gate and up rows of its column block (two
    accumulators, the [S, 2I] intermediate never reaches memory), rounds both to the model dtype as a
    GEMM's output is, adds the bias and applies the activation: `act` 0 is SiLU(gate) * up with gate
    and up the two halves of `w` (Qwen3-MoE), 1 is gpt-oss's clamped `(up + 1) * gate * sigmoid(alpha
    * gate)` with gate and up rows interleaved.

`rlhfkit::moe_down(a [S, I], offsets [E], w [E, H, I]) -> [S, H]`
    Program (m, n) multiplies expert e's rows of `a` (contiguous in the grouped order) by its block of
    `w`'s rows; the output is rounded to the model dtype. The bias, the router weights and the sum
    over a token's k rows stay in the compiled function around the ops (model/experts.py).

`offsets` are the cumulative row counts per expert (int32), so the row range of every program is
read on the device and one captured CUDA graph serves any routing. Where the rows per expert are
many (prefill) the grouped GEMMs of torch are faster (`use_for`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

ACT_SILU, ACT_GPT_OSS = 0, 1
# above this many rows per expert on average, torch._grouped_mm's tiles do better (bench/moe_kernels.py)
MAX_ROWS_PER_EXPERT = 64


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def use_for(rows: int, num_experts: int, x: torch.Tensor) -> bool:
    """Whether the ops take a layer of `rows` grouped rows: CUDA, bf16 or fp16, few rows per expert."""
    return (x.is_cuda and available() and x.dtype in (torch.bfloat16, torch.float16)
            and rows <= MAX_ROWS_PER_EXPERT * num_experts)


def _block_m(rows: int, experts: int) -> int:
    per = -(-rows // max(1, experts))
    return 16 if per <= 16 else 32 if per <= 32 else 64


if triton is not None:

    @triton.jit
    def _expert_block(Offs, E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        """Program m's expert and rows: expert e's rows [start_e, end_e) are cut into blocks of BLOCK_M,
        the experts' blocks are numbered in order, and program m takes block m (e == E: no block)."""
        offs_e = tl.arange(0, E_POW2)
        emask = offs_e < E
        ends = tl.load(Offs + offs_e, mask=emask, other=0)
        starts = tl.load(Offs + offs_e - 1, mask=emask & (offs_e > 0), other=0)
        blocks = tl.where(emask, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        block_end = tl.cumsum(blocks, 0)
        pid_m = tl.program_id(0)
        e = tl.sum((block_end <= pid_m).to(tl.int32), 0)
        mine = offs_e == e
        row0 = tl.sum(tl.where(mine, starts + (pid_m - (block_end - blocks)) * BLOCK_M, 0), 0)
        end = tl.sum(tl.where(mine, ends, 0), 0)
        return e, row0, end

    @triton.jit
    def _moe_gate_up_kernel(X, Perm, Offs, W, B, Out, INTER, sx, swe, swn, sbe, so,
                            E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                            ACT: tl.constexpr, HAS_BIAS: tl.constexpr, alpha, limit,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e, row0, end = _expert_block(Offs, E, E_POW2, BLOCK_M)
        if e < E:
            pid_n = tl.program_id(1)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            nmask = offs_n < INTER
            if ACT == 0:  # gate rows [0, I), up rows [I, 2I)
                g_rows = offs_n
                u_rows = offs_n + INTER
            else:  # interleaved: gate 2n, up 2n + 1
                g_rows = 2 * offs_n
                u_rows = 2 * offs_n + 1
            w_base = W + e.to(tl.int64) * swe
            rows = row0 + tl.arange(0, BLOCK_M)
            mmask = rows < end
            tok = tl.load(Perm + rows, mask=mmask, other=0) // TOP_K
            a_ptr = X + tok.to(tl.int64)[:, None] * sx + offs_k[None, :]
            g_ptr = w_base + g_rows[:, None] * swn + offs_k[None, :]
            u_ptr = w_base + u_rows[:, None] * swn + offs_k[None, :]
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for _ in range(K // BLOCK_K):
                a = tl.load(a_ptr, mask=mmask[:, None], other=0.0)
                wg = tl.load(g_ptr, mask=nmask[:, None], other=0.0)
                wu = tl.load(u_ptr, mask=nmask[:, None], other=0.0)
                acc_g = tl.dot(a, tl.trans(wg), acc_g)
                acc_u = tl.dot(a, tl.trans(wu), acc_u)
                a_ptr += BLOCK_K
                g_ptr += BLOCK_K
                u_ptr += BLOCK_K
            dt = Out.dtype.element_ty
            g = acc_g.to(dt).to(tl.float32)  # a GEMM's output is rounded to the model dtype
            u = acc_u.to(dt).to(tl.float32)
            if HAS_BIAS:
                g = g + tl.load(B + e * sbe + g_rows, mask=nmask, other=0.0).to(tl.float32)[None, :]
                u = u + tl.load(B + e * sbe + u_rows, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if ACT == 0:
                out = g / (1.0 + tl.exp(-g)) * u
            else:
                g = tl.minimum(g, limit)
                u = tl.minimum(tl.maximum(u, -limit), limit)
                out = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
            tl.store(Out + rows.to(tl.int64)[:, None] * so + offs_n[None, :], out.to(dt),
                     mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _moe_down_kernel(A, Offs, W, Out, N, sa, swe, swn, so, E: tl.constexpr, E_POW2: tl.constexpr,
                         K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e, row0, end = _expert_block(Offs, E, E_POW2, BLOCK_M)
        if e < E:
            pid_n = tl.program_id(1)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            nmask = offs_n < N
            rows = row0 + tl.arange(0, BLOCK_M)
            mmask = rows < end
            a_ptr = A + rows.to(tl.int64)[:, None] * sa + offs_k[None, :]
            w_ptr = W + e.to(tl.int64) * swe + offs_n[:, None] * swn + offs_k[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for _ in range(K // BLOCK_K):
                a = tl.load(a_ptr, mask=mmask[:, None], other=0.0)
                w = tl.load(w_ptr, mask=nmask[:, None], other=0.0)
                acc = tl.dot(a, tl.trans(w), acc)
                a_ptr += BLOCK_K
                w_ptr += BLOCK_K
            tl.store(Out + rows.to(tl.int64)[:, None] * so + offs_n[None, :], acc.to(Out.dtype.element_ty),
                     mask=mmask[:, None] & nmask[None, :])


def _block_k(k: int) -> int:
    for b in (128, 64, 32, 16):
        if k % b == 0:
            return b
    raise ValueError(f"triton_moe: the reduced dimension ({k}) must be a multiple of 16")


def launch_gate_up(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor,
                   bias: torch.Tensor | None, top_k: int, act: int, alpha: float, limit: float,
                   out: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """Run the gate/up kernel into `out [S, I]` (any device Triton runs on; the op below checks shapes)."""
    e, two_i, k = w.shape
    inter = two_i // 2
    block_m = _block_m(perm.shape[0], e)
    grid = (triton.cdiv(perm.shape[0], block_m) + e, triton.cdiv(inter, block_n))
    _moe_gate_up_kernel[grid](x, perm, offsets, w, bias if bias is not None else w, out, inter, x.stride(0),
                              w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
                              E=e, E_POW2=triton.next_power_of_2(e), K=k, TOP_K=top_k, ACT=act,
                              HAS_BIAS=bias is not None, alpha=alpha, limit=limit, BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=min(_block_k(k), 128), num_warps=4, num_stages=3)
    return out


def launch_down(a: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                block_n: int = 64) -> torch.Tensor:
    """Run the down kernel into `out [S, N]`."""
    e, n, k = w.shape
    block_m = _block_m(a.shape[0], e)
    grid = (triton.cdiv(a.shape[0], block_m) + e, triton.cdiv(n, block_n))
    _moe_down_kernel[grid](a, offsets, w, out, n, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                           E=e, E_POW2=triton.next_power_of_2(e), K=k, BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=min(_block_k(k), 128), num_warps=4, num_stages=4)
    return out


def _check_unit_stride(name: str, *tensors: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"rlhfkit::{name} needs Triton")
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: unit stride along the last dimension expected")


@torch.library.custom_op("rlhfkit::moe_gate_up", mutates_args=())
def moe_gate_up(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor | None, top_k: int, act: int, alpha: float, limit: float) -> torch.Tensor:
    """The experts' gate/up GEMMs and activation for the grouped rows (module docstring) -> `[S, I]`."""
    _check_unit_stride("moe_gate_up", x, w)
    out = torch.empty((perm.shape[0], w.shape[1] // 2), dtype=x.dtype, device=x.device)
    if perm.shape[0]:
        launch_gate_up(x, perm, offsets, w, bias, top_k, act, alpha, limit, out)
    return out


@moe_gate_up.register_fake
def _moe_gate_up_fake(x, perm, offsets, w, bias, top_k, act, alpha, limit):
    return x.new_empty((perm.shape[0], w.shape[1] // 2))


@torch.library.custom_op("rlhfkit::moe_down", mutates_args=())
def moe_down(a: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The experts' down GEMMs for the grouped rows `a [S, I]` -> `[S, H]` (module docstring)."""
    _check_unit_stride("moe_down", a, w)
    out = torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype, device=a.device)
    if a.shape[0]:
        launch_down(a, offsets, w, out)
    return out


@moe_down.register_fake
def _moe_down_fake(a, offsets, w):
    return a.new_empty((a.shape[0], w.shape[1]))
