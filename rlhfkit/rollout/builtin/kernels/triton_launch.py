"""Triton on this machine, and how the builtin engine's kernels are launched.

`available()` says whether Triton can be used (a CUDA device and the package); `triton` and `tl` are the
package and its language module, None without it.

Programmatic dependent launch (`use_pdl`, Hopper and newer): the kernels of triton_attention.py,
triton_sampling.py and triton_gemm.py are launched with `launch_pdl`, so the GPU may start a kernel while the
one before it in the stream is still finishing. Each kernel reads only what no unfinished kernel writes
(positions, rope tables, sampling settings) before `griddepcontrol.wait`, which returns once the previous
kernel has finished and its writes are visible, and signals its own dependents once its main loop is done.
Every such kernel waits before it finishes, so a kernel's predecessors are all done once it is. The decode
step's kernel boundaries (launch, prologue, the previous kernel's tail) then overlap instead of adding up.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None
    tl = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


# None: programmatic dependent launch where the GPU has it (compute capability >= 9) and
# RLHFKIT_PDL is not "0"; True / False force it (benchmarks)
PDL_CONFIG: dict = {"enabled": None}


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch."""
    if triton is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if PDL_CONFIG["enabled"] is not None:
        return bool(PDL_CONFIG["enabled"])
    return os.environ.get("RLHFKIT_PDL", "1") != "0" and _pdl_capable(device.index or 0)


def pdl_launch(device: torch.device) -> dict:
    """Launch keyword arguments of a kernel with a `PDL` constexpr: `PDL=...` and `launch_pdl`."""
    on = use_pdl(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}

