"""Decode-step runner: eager on CPU, optionally torch.compile'd and replayed as CUDA graphs on GPU.

One decode step = model forward over rows 0..B-1 + sampling + state update, reading and writing
only `SlotState` and the KV cache, so its inputs never change address: a step captured once per
(B, kv_len, filtered) key is replayed `steps` times with no host work in between.

    run(B, Lb, filtered, steps):
        graph = graphs[(B, Lb, filtered)] or capture(...)    # lazily, first use of a bucket
        for _ in range(steps): graph.replay()

Capture runs the step for real once on a side stream (warm-up, and compilation when enabled);
the fields a step advances are snapshotted before and restored after, so capturing in the middle
of a generation changes nothing (the K/V the warm-up wrote at the next position is rewritten by
the real step before anything reads it). All graphs share one memory pool; they never run
concurrently. `reset()` drops the graphs (before the cache or the weights are reallocated).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from rlhfkit.rollout.builtin.model import DecoderModel, KVCache, decode_layer, final_logits
from rlhfkit.rollout.builtin.sampling import SlotState, sample_and_advance

log = logging.getLogger(__name__)


def _batch_dynamic(fn: Callable, dims: dict[int, tuple[int, ...]]) -> Callable:
    """Mark the batch (and KV length) dims of `fn`'s tensor arguments dynamic before each call.

    Only those dims vary between decode buckets; every weight shape stays static, so the
    generated kernels keep their compile-time sizes (a fully dynamic compile would lose them).
    """
    def call(*args):
        for i, ds in dims.items():
            for d in ds:
                torch._dynamo.maybe_mark_dynamic(args[i], d)
        return fn(*args)
    return call


def compile_model(model: DecoderModel) -> Callable:
    """Compile the decode layer, the logits head and the sampler (returns the compiled sampler).

    One compiled graph per function reused by every batch / length bucket: the layer graph serves
    all layers, which keeps compilation to seconds for deep models. Between the graphs Python
    runs, but inside a CUDA graph replay none of it remains.
    """
    layer = torch.compile(decode_layer)
    # decode_layer(spec, layer, k_cache, v_cache, x, rows, pos, cos, sin, bias, ...)
    model.layer_fn = _batch_dynamic(layer, {4: (0,), 5: (0,), 6: (0,), 7: (0,), 8: (0,), 9: (0, 3)})
    model.head_fn = _batch_dynamic(torch.compile(final_logits), {3: (0,)})
    # sample_and_advance(state, rows, logits, filtered, max_model_len)
    return _batch_dynamic(torch.compile(sample_and_advance), {1: (0,), 2: (0,)})


class DecodeRunner:
    def __init__(self, model: DecoderModel, cache: KVCache, state: SlotState, max_model_len: int, *,
                 cuda_graphs: bool, compile_step: bool):
        self.model, self.cache, self.state = model, cache, state
        self.max_model_len = max_model_len
        self.cuda_graphs = cuda_graphs
        device = state.tokens.device
        with torch.inference_mode():  # like the row indices of prefill: one compiled variant for both
            self._rows = torch.arange(state.tokens.shape[0], device=device)
        self.compiled = compile_step
        self.compile_error: str | None = None
        self._sample: Callable = compile_model(model) if compile_step else sample_and_advance
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.captures = 0

    def _guarded(self, fn: Callable[[], None]) -> None:
        """Run `fn`; should the compiled path fail (compilation happens on first use), log it,
        fall back to the eager functions for good (`compile_error` says why) and run it again."""
        if not self.compiled:
            return fn()
        snap = self.state.snapshot()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any torch.compile / inductor failure
            self.compile_error = f"{type(exc).__name__}: {exc}"[:2000]
            log.warning("torch.compile of the decode step failed, running it eagerly: %s", self.compile_error)
            self.compiled = False
            self.model.layer_fn, self.model.head_fn = decode_layer, final_logits
            self._sample = sample_and_advance
            self.state.restore(snap)
            return fn()

    def sample(self, rows: torch.Tensor, logits: torch.Tensor, filtered: bool) -> None:
        """Sample the first token of freshly prefilled `rows` (eager launch of the same sampler)."""
        self._guarded(lambda: self._sample(self.state, rows, logits, filtered, self.max_model_len))

    def _call(self, nrows: int, kv_len: int, filtered: bool) -> None:
        logits = self.model.decode(self.cache, self.state.tokens[:nrows], self.state.pos[:nrows], kv_len)
        self._sample(self.state, self._rows[:nrows], logits, filtered, self.max_model_len)

    def _capture(self, key: tuple[int, int, bool]) -> torch.cuda.CUDAGraph:
        snap = self.state.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._guarded(lambda: self._call(*key))
                self.state.restore(snap)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._call(*key)
        self.captures += 1
        log.debug("captured decode graph rows=%d kv_len=%d filtered=%s", *key)
        return graph

    def run(self, nrows: int, kv_len: int, filtered: bool, steps: int) -> None:
        if not self.cuda_graphs:
            for _ in range(steps):
                self._guarded(lambda: self._call(nrows, kv_len, filtered))
            return
        key = (nrows, kv_len, filtered)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(key)
        for _ in range(steps):
            graph.replay()

    def warmup(self, nrows: int, kv_lens: list[int], filtered: bool = False) -> None:
        """Compile and capture the steps for `nrows` rows at each of `kv_lens` ahead of time.

        Meant for an idle engine (every row done): the warm-up steps then only write K/V into
        free slots, which admission overwrites.
        """
        for kv_len in kv_lens:
            key = (nrows, kv_len, filtered)
            if self.cuda_graphs and key not in self._graphs:
                self._graphs[key] = self._capture(key)
            elif not self.cuda_graphs:
                snap = self.state.snapshot()
                self._guarded(lambda: self._call(*key))
                self.state.restore(snap)

    def reset(self) -> None:
        self._graphs.clear()
