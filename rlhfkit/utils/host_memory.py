"""This process's resident memory from /proc/self (Linux): the current size, and the peak since a reset.

    reset_peak()                       # VmHWM starts again from the current RSS
    before = status_bytes("VmRSS")
    ...                                # the work measured
    peak_extra = status_bytes("VmHWM") - before
"""

from __future__ import annotations


def status_bytes(key: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
