"""Where compiled kernels are kept between runs, so that a second run does not compile again.

    use_persistent_cache() -> the folder of torch.compile's caches (TorchInductor's FX graph, AOT and
                              autotuning caches), set before anything compiles

TORCHINDUCTOR_CACHE_DIR when set; else `$XDG_CACHE_HOME/rlhfkit/torchinductor` (default
`~/.cache/rlhfkit/torchinductor`), which outlives a reboot where torch's own default (a folder under
/tmp) may not. Triton keeps the kernels it builds (rlhfkit's engine kernels included) in
TRITON_CACHE_DIR, by default `~/.triton/cache`; rlhfkit leaves that as it is. Deleting either folder
only costs the next run its compilation.
"""

from __future__ import annotations

import os


def use_persistent_cache() -> str:
    """Point TorchInductor's caches at a folder that lasts (unless the user chose one) and return it."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, "rlhfkit", "torchinductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
