"""FlashAttention-4 (CuTe DSL, flash_attn.cute) against SDPA's cuDNN kernel at the SFT bench's attention
shape (issue 18): Qwen2-0.5B, 8 x 2048, 14 query heads, 2 kv heads, head dim 64, causal, bf16.

    python3 bench/probe/fa4_attn.py [--out PATH]

Forward and forward + backward times (CUDA events, median of 20 after warm-up), and the largest
difference between the two kernels' outputs and gradients. flash_attn.cute must be importable.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args()
    B, S, H, KV, D = a.batch, a.seq, 14, 2, 64
    torch.manual_seed(0)
    dev = "cuda"
    # BSHD storage, as the model's projections give it
    q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, KV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, KV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
    flops_fwd = 4 * B * H * S * S * D / 2
    res = {"device": torch.cuda.get_device_name(), "shape": [B, S, H, KV, D], "causal": True}

    def sdpa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True).transpose(1, 2)

    def both(f):
        def run():
            q.grad = k.grad = v.grad = None
            o = f()
            o.backward(do)
            return o
        return run

    with torch.no_grad():
        res["cudnn_fwd_ms"] = timed(sdpa)
    res["cudnn_fwdbwd_ms"] = timed(both(sdpa))
    o_ref = both(sdpa)()
    g_ref = [t.grad.clone() for t in (q, k, v)]
    t0 = time.time()
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001
        res["fa4_error"] = f"import: {type(e).__name__}: {e}"[:400]
        print(json.dumps(res))
        return

    def fa4():
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out

    try:
        o4 = both(fa4)()
        res["fa4_first_call_s"] = time.time() - t0
        g4 = [t.grad.clone() for t in (q, k, v)]
        res["max_abs_diff"] = {"out": (o4 - o_ref).abs().max().item(),
                               **{n: (x - y).abs().max().item() for n, x, y in zip("qkv", g4, g_ref)}}
        res["ref_max_abs"] = {"out": o_ref.abs().max().item(), **{n: y.abs().max().item() for n, y in zip("qkv", g_ref)}}
        with torch.no_grad():
            res["fa4_fwd_ms"] = timed(fa4)
        res["fa4_fwdbwd_ms"] = timed(both(fa4))
    except Exception as e:  # noqa: BLE001
        import traceback
        res["fa4_error"] = f"{type(e).__name__}: {e}"[:600]
        traceback.print_exc()
    for key in ("cudnn", "fa4"):
        if f"{key}_fwd_ms" in res:
            res[f"{key}_fwd_tflops"] = flops_fwd / res[f"{key}_fwd_ms"] / 1e9
            res[f"{key}_bwd_ms"] = res[f"{key}_fwdbwd_ms"] - res[f"{key}_fwd_ms"]
            res[f"{key}_bwd_tflops"] = 2.5 * flops_fwd / res[f"{key}_bwd_ms"] / 1e9
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
