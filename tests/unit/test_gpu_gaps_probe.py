"""bench/probe/gpu_gaps.py: busy time, idle gaps and the kernels around them, on a hand-made trace."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "probe"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from gpu_gaps import gaps_of  # noqa: E402


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_overlaps_count_once_and_small_gaps_are_boundaries():
    # us: a 0-10 and b 5-15 overlap; c starts 15 us after b ends; d 1 us after c (a boundary); the
    # copy e follows d at once; a host op is no GPU time
    ev = [_x("kernel", "a", 0, 10), _x("kernel", "b", 5, 10), _x("kernel", "c", 30, 5), _x("kernel", "d", 36, 4),
          _x("gpu_memcpy", "e", 40, 10), _x("cpu_op", "aten::mm", 0, 100)]
    g = gaps_of({"traceEvents": ev}, min_gap_us=3.0)
    assert g["kernels"] == 5
    assert g["span_ms"] == pytest.approx(0.050)
    assert g["busy_ms"] == pytest.approx(0.034)  # 15 + 5 + 4 + 10
    assert g["idle_ms"] == pytest.approx(0.016)
    assert g["idle_in_gaps_over_min_ms"] == pytest.approx(0.015) and g["n_gaps"] == 1
    assert g["top_pairs"] == [{"before": "b", "after": "c", "n": 1, "ms": 0.015}]
