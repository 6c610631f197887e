"""Decode-step runner: eager on CPU, optionally torch.compile'd and replayed as CUDA graphs on GPU.

One decode step = model forward over rows 0..B-1 + sampling + state update, reading and writing
only `SlotState` and the KV cache, so its inputs never change address: a step captured once per
(B, Lb, filtered) key is replayed `steps` times with no host work in between. With the Triton
attention (GPU default) the step reads each row's length from `pos`, so Lb drops out of the key
and one graph per batch bucket serves every context length.

    run(B, Lb, filtered, steps):
        graph = graphs[(B, Lb or 0, filtered)] or capture(...)    # lazily, first use of a bucket
        for _ in range(steps): graph.replay()

Capture runs the step for real once on a side stream (warm-up, and compilation when enabled);
the fields a step advances are snapshotted before and restored after, so capturing in the middle
of a generation changes nothing (the K/V the warm-up wrote at the next position is rewritten by
the real step before anything reads it). All graphs share one memory pool; they never run
concurrently. `reset()` drops the graphs (before the cache or the weights are reallocated).
Should a fast path fail on first use, the runner falls back for good, first from torch.compile
to eager, then from the Triton kernels to SDPA and the torch sampler (`compile_error` says why).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from rlhfkit.rollout.builtin.loop.sampling import SlotState, sample_and_advance
from rlhfkit.rollout.builtin.model.decoder import DecoderModel, KVCache, decode_layer, final_logits, prefill_layer

log = logging.getLogger(__name__)


def _batch_dynamic(fn: Callable, dims: dict[int, tuple[int, ...]]) -> Callable:
    """Mark the batch (and length) dims of `fn`'s tensor arguments dynamic before each call
    (negative dims count from the end: the batch dim of `[B, H]` and of partials `[S, B, H]`).

    Only those dims vary between buckets; every weight shape stays static, so the generated
    kernels keep their compile-time sizes (a fully dynamic compile would lose them).
    """
    def call(*args):
        for i, ds in dims.items():
            if isinstance(args[i], torch.Tensor):
                for d in ds:
                    torch._dynamo.maybe_mark_dynamic(args[i], d if d >= 0 else args[i].dim() + d)
        return fn(*args)
    return call


def compile_model(model: DecoderModel, prefill: bool = True, mode: str | None = None) -> Callable:
    """Compile the decode layer, the logits head, the sampler (returned) and, with `prefill`, the
    prefill layer. `mode` is torch.compile's mode for the decode layer and head (e.g.
    "max-autotune-no-cudagraphs" to let inductor benchmark Triton GEMMs against cuBLAS).

    One compiled graph per function reused by every batch / length bucket: the layer graph serves
    all layers, which keeps compilation to seconds for deep models. Between the graphs Python
    runs, but inside a CUDA graph replay none of it remains.
    """
    # one graph per kind of layer (model/families.py LayerKind: window, rope table, experts), per final-layer
    # prefill variant and per size-1 specialisation: a family with local and global layers needs more
    # than dynamo's default of 8 before it would fall back to running a function eagerly
    from torch._dynamo import config as dynamo_config

    from rlhfkit.compile_cache import use_persistent_cache

    use_persistent_cache()
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    # decode_layer(spec, layer, k_cache, v_cache, x, delta, pos, cos, sin, bias, scale, attn, gemm)
    model.layer_fn = _batch_dynamic(torch.compile(decode_layer, mode=mode), {4: (0,), 5: (-2,), 6: (0,), 9: (0, 3)})
    # final_logits(spec, final_norm, lm_head, x, delta)
    model.head_fn = _batch_dynamic(torch.compile(final_logits, mode=mode), {3: (0,), 4: (-2,)})
    if prefill:  # prefill_layer(spec, layer, x [b, P, H], cos [P, 1, D], sin, scale, last [b] | None)
        model.prefill_fn = _batch_dynamic(torch.compile(prefill_layer), {2: (0, 1), 3: (0,), 4: (0,), 6: (0,)})
    # sample_and_advance(state, rows, logits, filtered, max_model_len)
    return _batch_dynamic(torch.compile(sample_and_advance), {1: (0,), 2: (0,)})


class DecodeRunner:
    def __init__(self, model: DecoderModel, cache: KVCache, state: SlotState, max_model_len: int, *,
                 cuda_graphs: bool, compile_step: bool, compile_prefill: bool = False,
                 compile_mode: str | None = None):
        self.model = model
        # None while the engine sleeps (StepRunner.sleep frees them; wake_up gives new ones)
        self.cache: KVCache | None = cache
        self.state: SlotState | None = state
        self.max_model_len = max_model_len
        self.cuda_graphs = cuda_graphs
        self.compiled = compile_step
        self.compile_error: str | None = None
        self._sample: Callable = sample_and_advance
        if compile_step:
            self._sample = compile_model(model, compile_prefill, compile_mode)
        self.fast_sampling = True  # the Triton sampler on CUDA (unfiltered batches)
        self._eager_sampler: set[tuple[bool, bool]] = set()  # (all rows, filtered) variants compile failed
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.captures = 0

    # ---------------------------------------------------------------- fallbacks
    def _fall_back(self, exc: Exception) -> bool:
        """Drop the next fast path after a failure: first torch.compile, then the Triton kernels.
        Returns False when nothing is left to drop."""
        msg = f"{type(exc).__name__}: {exc}"[:2000]
        self._eager_sampler.clear()
        if self.compiled:
            self.compiled = False
            self.model.layer_fn, self.model.head_fn, self.model.prefill_fn = decode_layer, final_logits, prefill_layer
            self._sample = sample_and_advance
            what = "torch.compile of the decode step"
        elif self.model.attn == "triton" or self.model.gemm == "triton" or self.fast_sampling:
            if self.model.attn == "triton":
                self.model.attn = "sdpa"
            self.model.gemm = "torch"
            self.fast_sampling = False
            what = "the Triton decode kernels"
        else:
            return False
        self._note(msg)
        log.warning("%s failed, falling back: %s", what, msg)
        return True

    def _buffers(self) -> tuple[KVCache, SlotState]:
        if self.cache is None or self.state is None:
            raise RuntimeError("the engine is asleep: its KV cache and slot state are freed")
        return self.cache, self.state

    def _note(self, msg: str) -> None:
        self.compile_error = msg if self.compile_error is None else f"{self.compile_error}; {msg}"

    def _run_sampler(self, rows: torch.Tensor | None, logits: torch.Tensor, filtered: bool) -> None:
        """The compiled sampler, or the eager one for a (rows, filtered) variant whose compilation
        failed: such a failure costs that variant alone, not the compiled decode layers."""
        args = (self._buffers()[1], rows, logits, filtered, self.max_model_len, self.fast_sampling)
        key = (rows is None, filtered)
        if self._sample is sample_and_advance or key in self._eager_sampler:
            return sample_and_advance(*args)
        if self.cuda_graphs and torch.cuda.is_current_stream_capturing():
            return self._sample(*args)  # compiled (or failed) in the warm-up runs before the capture
        try:
            return self._sample(*args)
        except Exception as exc:  # noqa: BLE001 - an inductor failure of this variant
            self._eager_sampler.add(key)
            msg = f"sampler (all_rows={key[0]}, filtered={filtered}) runs eagerly: {type(exc).__name__}: {exc}"
            self._note(msg[:2000])
            log.warning("torch.compile of the %s", msg[:2000])
        return sample_and_advance(*args)

    def _guarded(self, fn: Callable[[], None]) -> None:
        """Run `fn`; should a fast path fail (compilation and kernel builds happen on first use), log
        it, fall back for good (`compile_error` says why) and run it again."""
        while True:
            # runs for every eager step: no copy of the [S, V] presence mask (a failed step sets at
            # most its own sampled token there, which the retry samples again)
            state = self._buffers()[1]
            snap = state.snapshot(with_seen=False)
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - any torch.compile / inductor / Triton failure
                if not self._fall_back(exc):
                    raise
                state.restore(snap)

    def prefill(self, *args) -> torch.Tensor:
        """`model.prefill(*args)`, falling back to the eager prefill layer should the compiled one fail."""
        try:
            return self.model.prefill(*args)
        except Exception as exc:  # noqa: BLE001
            if self.model.prefill_fn is prefill_layer:
                raise
            self.model.prefill_fn = prefill_layer
            self._note(f"prefill: {type(exc).__name__}: {exc}"[:2000])
            log.warning("torch.compile of the prefill layer failed, running it eagerly: %s", self.compile_error)
            return self.model.prefill(*args)

    # ---------------------------------------------------------------- steps
    def sample(self, rows: torch.Tensor, logits: torch.Tensor, filtered: bool) -> None:
        """Sample the first token of freshly prefilled `rows` (eager launch of the same sampler)."""
        self._guarded(lambda: self._run_sampler(rows, logits, filtered))

    def _call(self, nrows: int, kv_len: int, filtered: bool) -> None:
        cache, state = self._buffers()
        logits = self.model.decode(cache, state.tokens[:nrows], state.pos[:nrows], kv_len)
        self._run_sampler(None, logits, filtered)

    def _key(self, nrows: int, kv_len: int, filtered: bool) -> tuple[int, int, bool]:
        """Graph key: the length bucket only matters to the bucketed (SDPA / matmul) attention."""
        return nrows, kv_len if self.model.uses_kv_len else 0, filtered

    def _capture(self, nrows: int, kv_len: int, filtered: bool) -> torch.cuda.CUDAGraph:
        state = self._buffers()[1]
        snap = state.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._guarded(lambda: self._call(nrows, kv_len, filtered))
                state.restore(snap)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._call(nrows, kv_len, filtered)
        self.captures += 1
        log.debug("captured decode graph rows=%d kv_len=%d filtered=%s", nrows, kv_len, filtered)
        return graph

    def _graph(self, nrows: int, kv_len: int, filtered: bool) -> torch.cuda.CUDAGraph:
        graph = self._graphs.get(self._key(nrows, kv_len, filtered))
        if graph is None:
            graph = self._capture(nrows, kv_len, filtered)  # its warm-up runs may fall back a path
            self._graphs[self._key(nrows, kv_len, filtered)] = graph
        return graph

    def run(self, nrows: int, kv_len: int, filtered: bool, steps: int) -> None:
        graph = self._graph_or_none(nrows, kv_len, filtered) if self.cuda_graphs else None
        if graph is None:
            for _ in range(steps):
                self._guarded(lambda: self._call(nrows, kv_len, filtered))
            return
        for _ in range(steps):
            graph.replay()

    def _graph_or_none(self, nrows: int, kv_len: int, filtered: bool) -> torch.cuda.CUDAGraph | None:
        """The step's graph; should capturing fail (e.g. a collective the NCCL build cannot capture),
        CUDA graphs are off for good and the steps run eagerly (`compile_error` says why). A
        tensor-parallel shard stays in step with the others either way: a replay issues the same
        collectives in the same order as an eager step."""
        try:
            return self._graph(nrows, kv_len, filtered)
        except Exception as exc:  # noqa: BLE001
            self.cuda_graphs = False
            self._graphs.clear()
            self._note(f"CUDA graph capture: {type(exc).__name__}: {exc}"[:2000])
            log.warning("CUDA graph capture failed, decoding without graphs: %s", exc)
            return None

    def warmup(self, nrows: int, kv_lens: list[int], filtered: bool = False) -> None:
        """Compile and capture the steps for `nrows` rows at each of `kv_lens` ahead of time, and
        replay each new graph once (its first replay uploads it to the device).

        Meant for an idle engine (every row done): the warm-up steps then only write K/V into
        free slots, which admission overwrites.
        """
        done: set[tuple[int, int, bool]] = set(self._graphs)
        for kv_len in kv_lens:
            key = self._key(nrows, kv_len, filtered)
            if key in done:
                continue
            state = self._buffers()[1]
            snap = state.snapshot()
            if self.cuda_graphs:
                self._graph(nrows, kv_len, filtered).replay()
            else:
                self._guarded(lambda: self._call(nrows, kv_len, filtered))
            state.restore(snap)
            done.add(self._key(nrows, kv_len, filtered))

    def reset(self) -> None:
        """Drop the graphs (before the cache or the weights are reallocated). Their memory pool goes
        with them: a new capture gets a new pool (reusing a pool whose graphs were all freed trips
        the caching allocator's use-count assertion)."""
        self._graphs.clear()
        if self.cuda_graphs:
            self._pool = torch.cuda.graph_pool_handle()
