"""Timing helpers of the benches: device syncs, means and medians, CUDA-event timing of a GPU call."""

from __future__ import annotations

import statistics

import torch


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a host clock reading after it covers that work."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def median_ms(fn, repeat: int = 5) -> float:
    """Median milliseconds of `fn()` over `repeat` calls, timed with CUDA events (GPU work only)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
