"""Probe (not a benchmark of record): the fused head's row kernel (models/head_kernels.py) writing S in place over
[16384, 151936] bf16 logits, against persistent variants whose second pass may hit L2 (fewer rows in flight, the
second pass run backwards). Prints ms per call."""
import json
import sys
import os

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from rlhfkit.models import head_kernels as hk  # noqa: E402


@triton.jit
def _persist(z_ptr, stride, tgt_ptr, lp_ptr, lse_ptr, n, V, inv_t, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    nblk = tl.cdiv(V, BLOCK)
    for row32 in range(pid, n, nprog):
        row = row32.to(tl.int64)
        base = z_ptr + row * stride
        m = tl.full([BLOCK], -1.0e30, tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for b in range(0, nblk):
            cols = b * BLOCK + lanes
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
        for i in range(0, nblk):
            b = nblk - 1 - i if REVERSE else i
            cols = b * BLOCK + lanes
            inb = cols < V
            x = tl.load(base + cols, mask=inb, other=0.0).to(tl.float32) * inv_t
            s = tl.where(cols == tgt, 1.0, 0.0) - tl.exp(x - lse)
            tl.store(base + cols, s.to(z_ptr.dtype.element_ty), mask=inb)


def main():
    n, V = 16384, 151936
    torch.manual_seed(0)
    z0 = (torch.randn(n, V, device="cuda") * 2).to(torch.bfloat16)
    tgt = torch.randint(0, V, (n,), device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {}

    def timeit(name, fn):
        z = z0.clone()
        fn(z)
        torch.cuda.synchronize()
        ts = []
        for _ in range(8):
            z.copy_(z0)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(z)
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        res[name] = sorted(ts)[len(ts) // 2]
        print(name, round(res[name], 3), "ms", flush=True)
        return z

    ref = timeit("current", lambda z: hk.row_stats(z, tgt, 1.0, False, True))
    lp = torch.empty(n, device="cuda")
    lse = torch.empty(n, device="cuda")
    for g_mult in (1, 2, 4):
        for warps, block in ((8, 4096), (16, 8192), (16, 4096), (32, 8192)):
            for rev in (False, True):
                name = f"persist_g{g_mult}x_w{warps}_b{block}_{'rev' if rev else 'fwd'}"
                try:
                    out = timeit(name, lambda z: _persist[(sms * g_mult,)](z, z.stride(0), tgt, lp, lse, n, V, 1.0,
                                                                          BLOCK=block, REVERSE=rev, num_warps=warps))
                    res[name + "_maxdiff"] = float((out[:64].float() - ref[:64].float()).abs().max())
                except Exception as e:  # noqa: BLE001
                    print(name, "failed", type(e).__name__, str(e)[:200])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
