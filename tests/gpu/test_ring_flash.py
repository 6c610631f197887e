"""Ring attention's CUDA kernel path (parallel/ring_blocks.py) on 2 GPUs over NCCL.

Two spawned processes (one GPU each) run `ring_attention` on a ring of 2:

* accuracy: bf16 inputs, a packed row of three sequences (lengths 1237, 2011, 1555, then 197 padding
  tokens), GQA 14 query / 2 KV heads of dim 64, causal, zig-zag. The kernel "auto" picks (flash, or the
  efficient kernel where the flash probe fails) and the math path, and flash with one KV head per ring
  pass, against a float32 full-attention reference on the same (bf16-rounded) inputs: out, dq, dk, dv
  within 2e-2 of max(1, the reference's largest value); padding rows give 0.
* speed: one forward + backward of one 32k-token row (one sequence), 14 / 2 heads of dim 64, bf16, with
  the fast kernel and with the math path; both times are printed (and written with the peak memory to
  $OUT/ring_flash_h100x2.json when OUT is set), and the two outputs agree.

    PYTHONPATH=$PWD python tests/gpu/test_ring_flash.py        # or: pytest -q tests/gpu/test_ring_flash.py
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

HQ, HK, D = 14, 2, 64
CU = [0, 1237, 3248, 4803]  # three sequences; the row is 5000 tokens (197 padding)
ROW = 5000
LONG = 32768
TOL = 2e-2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(q, k, v, cu):
    """float32 full attention per sequence: q [T, Hq, D], k/v [T, Hk, D]; padding rows 0."""
    g = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        s = (qs @ ks.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        n = b - a
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
    out = torch.cat(outs)
    return torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])


def _rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max()) / max(1.0, float(want.float().abs().max()))


def _accuracy(rank, world, dev):
    from rlhfkit.parallel.ring_attention import ring_attention, split_for_ring

    gen = torch.Generator().manual_seed(0)
    q, k, v, g_out = (torch.randn(ROW, h, D, generator=gen).to(dev, torch.bfloat16) for h in (HQ, HK, HK, HQ))
    ref_in = [t.float().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*ref_in, CU)
    ref_grads = torch.autograd.grad(ref, ref_in, g_out.float())

    def split(t):
        return split_for_ring(t, rank, world, dim=0)

    cu = torch.tensor(CU, dtype=torch.int32, device=dev)
    res = {}
    for name, kw in (("auto", {}), ("math", {"kernel": "math"}), ("auto_stride1", {"head_stride": 1})):
        loc = [split(t).detach().requires_grad_(True) for t in (q, k, v)]
        out = ring_attention(*loc, dist.group.WORLD, cu_seqlens=cu, **kw)
        grads = torch.autograd.grad(out, loc, split(g_out))
        errs = {"out": _rel_err(out.detach(), split(ref.detach()))}
        for n, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
            errs[n] = _rel_err(got, split(want))
        pad = split(torch.arange(ROW, device=dev)) >= CU[-1]
        errs["padding_abs"] = float(out.detach()[pad].float().abs().max()) if bool(pad.any()) else 0.0
        res[name] = errs
    return res


def _time(fn, iters):
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        res = fn()
    torch.cuda.synchronize()
    dist.barrier()
    return (time.perf_counter() - t0) / iters, res


def _speed(rank, world, dev):
    from rlhfkit.parallel.ring_attention import ring_attention, split_for_ring

    gen = torch.Generator().manual_seed(1)
    full = [torch.randn(LONG, h, D, generator=gen).to(dev, torch.bfloat16) for h in (HQ, HK, HK, HQ)]
    q, k, v, g_out = (split_for_ring(t, rank, world, dim=0) for t in full)
    del full
    cu = torch.tensor([0, LONG], dtype=torch.int32, device=dev)
    res, outs = {}, {}
    for name, kernel, iters in (("fast", "auto", 5), ("math", "math", 2)):
        def step(kernel=kernel):
            loc = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = ring_attention(*loc, dist.group.WORLD, cu_seqlens=cu, kernel=kernel)
            out.backward(g_out)
            return out.detach(), loc[0].grad
        step()  # warm-up (and the kernel probe)
        torch.cuda.reset_peak_memory_stats(dev)
        secs, outs[name] = _time(step, iters)
        res[name] = {"s_fwd_bwd": secs, "tokens_per_s": LONG / secs,
                     "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2 ** 30}
    res["fast_vs_math"] = {"out": _rel_err(outs["fast"][0], outs["math"][0]),
                           "dq": _rel_err(outs["fast"][1], outs["math"][1])}
    return res


def _worker(rank, world, port, out_dir):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from rlhfkit.parallel.ring_blocks import PROBE_FAILURES, pick_kernel

        kern = pick_kernel("auto", dev, torch.bfloat16, HQ, HK, D)
        res = {"kernel": None if kern is None else kern.name,
               "probe_failures": {str(key[0]): why for key, why in PROBE_FAILURES.items()},
               "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "accuracy": _accuracy(rank, world, dev), "speed_32k": _speed(rank, world, dev)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f, indent=1)
    finally:
        dist.destroy_process_group()


def run_ring_flash() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, _free_port(), tmp), nprocs=2, join=True)
        results = []
        for rank in range(2):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    sp = results[0]["speed_32k"]
    print(f"ring 2, one {LONG}-token row, {HQ}/{HK} heads of dim {D}, bf16, fwd+bwd: "
          f"{results[0]['kernel']} {sp['fast']['s_fwd_bwd'] * 1e3:.1f} ms, math {sp['math']['s_fwd_bwd'] * 1e3:.1f} ms "
          f"({sp['math']['s_fwd_bwd'] / sp['fast']['s_fwd_bwd']:.1f}x)")
    print(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "ring_flash_h100x2.json"), "w") as f:
            json.dump({"ranks": results}, f, indent=1)
    return results


def test_ring_flash_two_gpus():
    results = run_ring_flash()
    for rank, res in enumerate(results):
        assert res["kernel"] in ("flash", "efficient"), (rank, res["kernel"], res["probe_failures"])
        for case, errs in res["accuracy"].items():
            for name, err in errs.items():
                assert err < TOL, (rank, case, name, err)
        for name, err in res["speed_32k"]["fast_vs_math"].items():
            assert err < TOL, (rank, "32k fast vs math", name, err)
        assert res["speed_32k"]["fast"]["s_fwd_bwd"] < res["speed_32k"]["math"]["s_fwd_bwd"]


if __name__ == "__main__":
    if torch.cuda.device_count() < 2:
        sys.exit("test_ring_flash.py needs 2 CUDA devices")
    test_ring_flash_two_gpus()
    print("ring flash: OK")
