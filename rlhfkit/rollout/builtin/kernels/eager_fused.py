"""Small pieces of the decode step that run through torch.compile even when the step itself is eager.

An eager decode step replays as a CUDA graph, so it pays no launch latency on the host, but every kernel
still costs the GPU a few microseconds. Some pieces are a dozen tiny kernels eagerly and one or a few
fused ones compiled: the routed experts' routing, dispatch and weighted sum (the RMSNorms have a
Triton kernel of their own, kernels/triton_norm.py, which needs no tracing). `EagerFused(fn)` is `fn` compiled on CUDA with
dynamic shapes, used outside any compiled region (inside one, dynamo traces `fn` as written); on CPU,
inside a compiled step, when `bypass()` holds (e.g. while routing choices are recorded) or after a failed
compilation (logged once, eager for good) it is `fn` itself. Compilation happens on first use, which
the engine's CUDA graph capture runs ahead of the capture itself.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


def _on_cuda(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)


class EagerFused:
    """`fn`, compiled on CUDA outside compiled regions (module docstring)."""

    def __init__(self, fn: Callable, bypass: Callable[[], bool] = lambda: False,
                 wants: Callable[[tuple], bool] | None = None) -> None:
        self.fn, self.bypass = fn, bypass
        self.wants = wants or _on_cuda  # which calls go through the compiled function
        self.compiled: Callable | None = None
        self.failed: str | None = None

    def __call__(self, *args: Any) -> Any:
        if not self.wants(args) or self.failed is not None or torch.compiler.is_compiling() or self.bypass():
            return self.fn(*args)
        if self.compiled is None:
            from torch._dynamo import config as dynamo_config

            from rlhfkit.compile_cache import use_persistent_cache

            use_persistent_cache()
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
            self.compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 - an inductor failure: the eager function still runs
            self.failed = f"{type(exc).__name__}: {exc}"[:2000]
            log.warning("torch.compile of %s failed, running it eagerly: %s", self.fn.__name__, self.failed)
            return self.fn(*args)
