"""Where one step's time goes: its phases, the GPU's busy and idle time in each, and the kernels.

    from bench.harness.step_profile import profile_call
    summary = profile_call(lambda: trainer.train_step(), prefix="rl/", trace_path="/tmp/step.json")

The call runs once under torch.profiler (CPU + CUDA activity). Phases are the profiler ranges whose
name starts with `prefix` (the RL loop opens `rl/generate`, `rl/logprobs`, `rl/train`, ... through
`rlhfkit.trainers.metrics.PhaseClock`); a kernel belongs to the phase in which it was launched (the
CPU range holding its launch), so a kernel still running when its phase's CPU range ends is counted
with that phase. Per phase (and for the whole call):

    wall_s          the CPU range's length
    gpu_busy_s      the union of the phase's kernels' intervals (overlapping kernels counted once)
    gpu_idle_frac   1 - busy / wall: the time the GPU waited for the host (launch gaps, syncs, Python)
    kernels         number of kernels launched; launches_per_ms tells launch-bound phases apart
    classes_s       kernel time by class: gemm, attention, triton (compiled / fused), nccl, memcpy,
                    elementwise (everything else)
    top             the `top` kernels by total time (name cut to 90 characters, calls, seconds)
    largest_gaps_ms the six longest idle gaps: [start (ms after the phase began), length ms]
    idle_by_host_s  the GPU's idle gaps of 50 us or more, summed by what the host was doing meanwhile
                    (the innermost CPU op, runtime call or profiler range covering the gap's middle):
                    `cudaStreamSynchronize` / `aten::item` mean a wait, an aten op means launch-bound

`summarize_trace(trace_dict)` does the same on an exported Chrome trace (unit-testable on CPU).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

import torch

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CLASSES = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "attention", "attn")),
           ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul", "splitk")),
           ("triton", ("triton",)), ("memcpy", ("memcpy", "memset")))


def kernel_class(name: str, cat: str) -> str:
    low = name.lower()
    if cat != "kernel":
        return "memcpy"
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "elementwise"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _gaps(a: float, b: float, kernels: list[dict], min_us: float = 50.0) -> list[tuple[float, float]]:
    """The GPU's idle intervals within [a, b] (no kernel running) of at least `min_us`."""
    out, cur = [], a
    for k in sorted(kernels, key=lambda k: k["ts"]):
        if k["ts"] - cur >= min_us:
            out.append((cur, k["ts"]))
        cur = max(cur, k["ts"] + k["dur"])
    if b - cur >= min_us:
        out.append((cur, b))
    return out


def _idle_by_host(gaps: list[tuple[float, float]], host: list[dict], starts: list[float], top: int) -> dict:
    """Gap time summed by the innermost host event covering each gap's middle."""
    import bisect

    by: dict[str, float] = {}
    for a, b in gaps:
        mid = (a + b) / 2
        i = bisect.bisect_right(starts, mid)
        best = None
        for e in host[max(0, i - 4000):i][::-1]:
            if e["ts"] + e["dur"] >= mid and (best is None or e["dur"] < best["dur"]):
                best = e
        name = best["name"][:60] if best else "(no host event)"
        by[name] = by.get(name, 0.0) + (b - a) / 1e6
    return {n: round(v, 6) for n, v in sorted(by.items(), key=lambda kv: -kv[1])[:top]}


def _stats(wall_us: float, kernels: list[dict], top: int) -> dict[str, Any]:
    busy = _union([(k["ts"], k["ts"] + k["dur"]) for k in kernels]) / 1e6
    wall = wall_us / 1e6
    classes: dict[str, float] = {}
    per_name: dict[str, list[float]] = {}
    for k in kernels:
        cls = kernel_class(k["name"], k["cat"])
        classes[cls] = classes.get(cls, 0.0) + k["dur"] / 1e6
        rec = per_name.setdefault(k["name"][:90], [0, 0.0])
        rec[0] += 1
        rec[1] += k["dur"] / 1e6
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"wall_s": round(wall, 6), "gpu_busy_s": round(busy, 6),
            "gpu_idle_frac": round(1 - busy / wall, 4) if wall > 0 else None, "kernels": len(kernels),
            "launches_per_ms": round(len(kernels) / max(wall_us / 1e3, 1e-9), 3),
            "classes_s": {c: round(v, 6) for c, v in sorted(classes.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n, "calls": c, "s": round(s, 6)} for n, (c, s) in ranked]}


def summarize_trace(trace: dict, prefix: str = "rl/", top: int = 12) -> dict[str, Any]:
    """Phase / kernel summary of a Chrome trace exported by torch.profiler (module docstring)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in GPU_CATS]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    for k in kernels:  # the host time of the kernel's launch (its own start when the launch is unknown)
        k["launch_ts"] = launches.get(k.get("args", {}).get("correlation"), k["ts"])
    phases = sorted(((e["name"][len(prefix):], e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "user_annotation" and e["name"].startswith(prefix)), key=lambda p: p[1])
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    host = sorted(cpu + [e for e in events if e.get("cat") == "cuda_runtime"], key=lambda e: e["ts"])
    host_starts = [e["ts"] for e in host]
    starts = [p[1] for p in phases] or [e["ts"] for e in cpu + kernels]
    ends = [p[2] for p in phases] or [e["ts"] + e["dur"] for e in cpu + kernels]
    out: dict[str, Any] = {"whole": None, "phases": {}}
    if starts:
        a0, b0 = min(starts), max(ends)
        out["whole"] = _stats(b0 - a0, kernels, top)
        out["whole"]["idle_by_host_s"] = _idle_by_host(_gaps(a0, b0, kernels), host, host_starts, 8)
    for name, a, b in phases:
        mine = [k for k in kernels if a <= k["launch_ts"] < b]
        stats = _stats(b - a, mine, top)
        gaps = _gaps(a, b, mine)
        stats["idle_by_host_s"] = _idle_by_host(gaps, host, host_starts, 8)
        stats["largest_gaps_ms"] = [[round((g0 - a) / 1e3, 2), round((g1 - g0) / 1e3, 2)]
                                    for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:6]]
        prev = out["phases"].get(name)
        if prev is not None:  # a phase entered twice: keep both, numbered
            name = f"{name}#{sum(1 for n in out['phases'] if n.split('#')[0] == name) + 1}"
        out["phases"][name] = stats
    return out


def profile_call(fn: Callable[[], Any], prefix: str = "rl/", top: int = 12,
                 trace_path: str | None = None) -> dict[str, Any]:
    """Run `fn()` once under torch.profiler -> `summarize_trace` of it; the Chrome trace is kept at
    `trace_path` when given (open it in chrome://tracing or Perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    path = trace_path or os.path.join(tempfile.mkdtemp(prefix="step_profile_"), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    if trace_path is None:
        os.remove(path)
    return summarize_trace(trace, prefix, top)


def format_summary(summary: dict[str, Any]) -> str:
    """A short table: one line per phase (wall, GPU busy, idle, kernels, time by class)."""
    lines = [f"{'phase':<14}{'wall s':>9}{'busy s':>9}{'idle':>7}{'kernels':>9}  classes (s)"]
    rows = list(summary["phases"].items()) + ([("whole", summary["whole"])] if summary.get("whole") else [])
    for name, s in rows:
        cls = ", ".join(f"{c} {v:.3f}" for c, v in s["classes_s"].items())
        idle = f"{s['gpu_idle_frac']:.0%}" if s["gpu_idle_frac"] is not None else "-"
        lines.append(f"{name:<14}{s['wall_s']:>9.3f}{s['gpu_busy_s']:>9.3f}{idle:>7}{s['kernels']:>9}  {cls}")
        waits = ", ".join(f"{n} {v:.3f}" for n, v in list(s.get("idle_by_host_s", {}).items())[:4])
        if waits:
            lines.append(f"{'':<14}GPU idle while the host ran: {waits}")
    return "\n".join(lines)
