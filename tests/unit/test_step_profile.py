"""bench/harness/step_profile.py: GPU busy / idle, kernel classes and idle-by-host on a hand-made trace."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository: bench.harness
from bench.harness.step_profile import _union, format_summary, summarize_trace  # noqa: E402


def _x(cat, name, ts, dur, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_phase_busy_idle_classes_and_host_waits():
    # phase rl/train over 0-1000 us: kernels 0-100, 100-300, 250-400 (overlap counted once), then the
    # GPU idles 400-1000 while the host sits in a stream sync (380-950) and then in an aten op
    ev = [_x("user_annotation", "rl/train", 0, 1000), _x("user_annotation", "rl/sync", 1000, 10),
          _x("cuda_runtime", "cudaLaunchKernel", 0, 5, 1), _x("cuda_runtime", "cudaLaunchKernel", 10, 5, 2),
          _x("cuda_runtime", "cudaLaunchKernel", 20, 5, 3), _x("cuda_runtime", "cudaStreamSynchronize", 380, 570),
          _x("cpu_op", "aten::copy_", 950, 50),
          _x("kernel", "sm90_gemm_x", 0, 100, 1), _x("kernel", "triton_poi_fused", 100, 200, 2),
          _x("kernel", "flash_fwd", 250, 150, 3)]
    s = summarize_trace({"traceEvents": ev})
    t = s["phases"]["train"]
    assert t["gpu_busy_s"] == pytest.approx(400e-6)
    assert t["gpu_idle_frac"] == pytest.approx(0.6)
    assert t["classes_s"] == pytest.approx({"triton": 200e-6, "attention": 150e-6, "gemm": 100e-6})
    # the gap 400-1000 has its middle (700) inside the sync
    assert t["idle_by_host_s"] == pytest.approx({"cudaStreamSynchronize": 600e-6})
    assert s["phases"]["sync"]["kernels"] == 0
    assert "train" in format_summary(s)


def test_union_of_overlapping_intervals():
    assert _union([(0, 10), (5, 20), (30, 40), (35, 36)]) == 30
