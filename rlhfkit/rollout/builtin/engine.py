"""BuiltinEngine: the fast rollout engine (RolloutEngine protocol) for HF Llama/Qwen2/Qwen3/Mistral.

One engine step (`_step`, under the engine lock):

    inbox -> scheduler.waiting                       (requests from generate() / agenerate())
    admit: while slots are free, prefill waiting prompts (one prefill per request, its K/V
           copied to the request's n sample slots) and sample each sample's first token
    decode: `steps` decode steps over rows 0..B-1 (graph replays on GPU; no host sync)
    sync:  read done flags, lengths and each row's tokens since its last sync; finished rows ->
           Completion, slot freed; rows with stop strings are decoded and cut on the host
    compact: move high slots down when the batch can shrink

`steps` is `sync_every`, shortened so that no sequence runs past its max_new_tokens between syncs:
length finishes are seen at once; a row that hits eos stops on the device and its slot idles
until the next sync (at most `sync_every - 1` steps). Inside a `generate()` call with nothing
waiting for a slot and no stop strings to check, `sync_every_batch` is used instead: the caller
wants the whole batch anyway, so early finishers gain nothing from a sync and each sync is a host
round trip with the GPU idle (H100, batch 256: 131k vs 129k tok/s at 64 vs 16). There, while a
row may still run by length, the sync looks ahead: flags and lengths are copied without blocking
after the chunk and `lookahead_steps` more steps are queued before the host reads them, so the GPU
does not wait for the host (done rows are frozen; all rows done: those steps are wasted). `generate()` drives steps in the caller's
thread; `agenerate()` hands the request to a background thread that steps while any work is
pending, so concurrent agent episodes share one batch.

Memory: the KV cache is preallocated, 2 x layers x max_num_seqs x kv_heads x max_model_len x
head_dim elements; `sleep()` frees it (and the decode graphs), `wake_up()` reallocates it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import random
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from rlhfkit.rollout.builtin.model import (DECODE_ATTENTION, DECODE_GEMM, DecoderModel, KVCache,
                                           resolve_decode_attention, resolve_decode_gemm)
from rlhfkit.rollout.builtin.runner import DecodeRunner
from rlhfkit.rollout.builtin.sampling import SlotState
from rlhfkit.rollout.builtin.scheduler import (Admission, RequestState, SlotScheduler, batch_bucket,
                                                length_bucket)
from rlhfkit.rollout.builtin.weights import copy_named_tensors, load_from_hf_model, rope_tables
from rlhfkit.rollout.engine_utils import (EngineStats, Waiter, eos_ids_of, make_decode, to_device,
                                          validate_request)
from rlhfkit.rollout.stops import finish_completion, stop_string_cut
from rlhfkit.types import Completion, GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class BuiltinEngineConfig:
    """Sizes and switches of the builtin engine (KV cache = 2 x layers x slots x kv_heads x len x dim)."""

    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: min(max_position_embeddings, 2048)
    max_prefill_tokens: int = 16384
    sync_every: int = 16
    sync_every_batch: int = 64  # in generate() when no request waits and no stop strings are watched
    cuda_graphs: bool | None = None  # default: on for CUDA devices
    compile: bool | None = None  # torch.compile the decode step; default: on for CUDA devices
    max_stop_ids: int = 8
    seed: int = 0
    compile_prefill: bool | None = None  # torch.compile the prefill layer too; default: as `compile`
    compile_mode: str | None = None  # torch.compile mode of the decode layer / head, e.g. "max-autotune-no-cudagraphs"
    # "auto": "triton" (fused RoPE + K/V write + attention kernel) on CUDA when Triton and the head
    # shape allow, else "sdpa"; "matmul": two batched matmuls (no SDPA kernel)
    decode_attention: str = "auto"
    fast_sampling: bool = True  # on CUDA, the one-pass Triton sampler for batches without top-k / top-p
    # "auto": "triton" (fused gate/up + SiLU and split-K o / down projections) on CUDA for batches of at
    # least `gemm_min_rows` rows when Triton and the model allow, else "torch" (cuBLAS)
    decode_gemm: str = "auto"
    gemm_min_rows: int = 64
    lookahead_steps: int | None = None  # decode steps queued while a batch-mode sync is read; default 4 on CUDA, 0 on CPU

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_prefill_tokens", "sync_every", "sync_every_batch", "max_stop_ids",
                     "gemm_min_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"BuiltinEngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.lookahead_steps is not None and self.lookahead_steps < 0:
            raise ValueError(f"BuiltinEngineConfig.lookahead_steps must be >= 0, got {self.lookahead_steps}")
        if self.decode_attention not in ("auto",) + DECODE_ATTENTION:
            raise ValueError(f"BuiltinEngineConfig.decode_attention must be one of {('auto',) + DECODE_ATTENTION}, "
                             f"got {self.decode_attention!r}")
        if self.decode_gemm not in ("auto",) + DECODE_GEMM:
            raise ValueError(f"BuiltinEngineConfig.decode_gemm must be one of {('auto',) + DECODE_GEMM}, "
                             f"got {self.decode_gemm!r}")


class BuiltinEngine:
    """Continuous-batching engine over its own copy of an HF model's weights.

    Example:
        engine = BuiltinEngine(hf_model, tokenizer, device="cuda", dtype=torch.bfloat16)
        [[c]] = engine.generate([GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=8))])
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, config: BuiltinEngineConfig | None = None,
                 eos_token_ids: list[int] | None = None):
        self.config = config or BuiltinEngineConfig()
        self.config.validate()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or next(model.parameters()).dtype
        self.tokenizer = tokenizer
        self._decode_text = make_decode(tokenizer)
        self.eos_token_ids = eos_ids_of(model, tokenizer) if eos_token_ids is None else list(eos_token_ids)
        self.spec, weights = load_from_hf_model(model, self.dtype, self.device)
        cfg = self.config
        self.max_model_len = cfg.max_model_len or min(self.spec.max_position_embeddings, 2048)
        if self.spec.sliding_window is not None and self.max_model_len > self.spec.sliding_window:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's sliding window "
                             f"{self.spec.sliding_window}, which the builtin engine does not implement")
        cos, sin = rope_tables(model.config, self.spec, self.max_model_len, self.dtype, self.device)
        attn = resolve_decode_attention(cfg.decode_attention, self.spec, self.device)
        gemm = resolve_decode_gemm(cfg.decode_gemm, self.spec, weights, self.device)
        self.model = DecoderModel(self.spec, weights, cos, sin, attn, gemm, cfg.gemm_min_rows)
        on_cuda = self.device.type == "cuda"
        self._graphs = on_cuda if cfg.cuda_graphs is None else cfg.cuda_graphs
        self._compile = on_cuda if cfg.compile is None else cfg.compile
        self._compile_prefill = self._compile if cfg.compile_prefill is None else cfg.compile_prefill
        self._lookahead = (4 if on_cuda else 0) if cfg.lookahead_steps is None else cfg.lookahead_steps
        self._h2d = functools.partial(to_device, device=self.device)
        if self._graphs and not on_cuda:
            raise ValueError("BuiltinEngineConfig.cuda_graphs needs a CUDA device")
        self.stats = EngineStats()
        self._rng = random.Random(cfg.seed)  # seeds of requests without one (host side: no torch op per request)
        self._lock = threading.RLock()
        self._inbox: queue.SimpleQueue[RequestState] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._worker: threading.Thread | None = None
        self._closing = False
        self._sleep_level = 0
        self._allocate_runtime()

    # ---------------------------------------------------------------- memory
    def _allocate_runtime(self) -> None:
        cfg = self.config
        need = KVCache.bytes_needed(self.spec, cfg.max_num_seqs, self.max_model_len, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > free:
                raise ValueError(f"the KV cache needs {need / 2**30:.1f} GiB ({cfg.max_num_seqs} slots x "
                                 f"{self.max_model_len} tokens) but {free / 2**30:.1f} GiB are free: lower "
                                 "max_num_seqs or max_model_len")
        self.cache = KVCache.allocate(self.spec, cfg.max_num_seqs, self.max_model_len, self.dtype, self.device)
        self.state = SlotState.allocate(cfg.max_num_seqs, self.max_model_len, cfg.max_stop_ids, self.device)
        self.sched = SlotScheduler(cfg.max_num_seqs, cfg.max_prefill_tokens)
        self.runner = DecodeRunner(self.model, self.cache, self.state, self.max_model_len,
                                   cuda_graphs=self._graphs, compile_step=self._compile,
                                   compile_prefill=self._compile_prefill, compile_mode=cfg.compile_mode)
        self.runner.fast_sampling = cfg.fast_sampling

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and decode graphs (level 1); level 2 also moves the weights to CPU."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._lock:
            self._drain_inbox()
            if self.sched.busy():
                raise RuntimeError("BuiltinEngine.sleep() called with requests in flight")
            self.runner.reset()
            del self.runner, self.cache, self.state
            if level == 2:
                self._move_weights(torch.device("cpu"))
            self._sleep_level = level
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake_up(self) -> None:
        with self._lock:
            if self._sleep_level == 0:
                return
            if self._sleep_level == 2:
                self._move_weights(self.device)
            self._sleep_level = 0
            self._allocate_runtime()

    def _move_weights(self, device: torch.device) -> None:
        w = self.model.weights
        w.replace_tensors({k: v.to(device) for k, v in w.tensors().items()})
        self.model.cos, self.model.sin = self.model.cos.to(device), self.model.sin.to(device)

    def warmup(self, num_rows: int | None = None, filtered: bool = False) -> None:
        """Compile / capture the decode step for `num_rows` rows (default: all slots) at every KV
        length bucket up to max_model_len, so that no capture happens while generating."""
        lens, n = [], 1
        while not lens or lens[-1] < self.max_model_len:
            lens.append(length_bucket(n, self.max_model_len))
            n = lens[-1] + 1
        rows = batch_bucket(num_rows or self.config.max_num_seqs, self.config.max_num_seqs)
        with self._lock, torch.inference_mode():
            if self.sched.busy():
                raise RuntimeError("BuiltinEngine.warmup() needs an idle engine")
            self.runner.warmup(rows, lens, filtered)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the engine's weights in place (graphs stay valid)."""
        with self._lock:
            copy_named_tensors(self.model.weights, self.spec, named_tensors)
            self.stats.weight_updates += 1

    # ---------------------------------------------------------------- public generation API
    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        waiter = Waiter(len(requests))
        states = [self._prepare(req, lambda out, i=i: waiter.set(i, out)) for i, req in enumerate(requests)]
        self._enqueue(states)
        while not waiter.done.is_set():
            with self._lock:
                if waiter.done.is_set():
                    break
                self._run_step(batch=True)
        return waiter.results()

    async def agenerate(self, request: GenerationRequest) -> list[Completion]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def resolve(out: list[Completion] | BaseException) -> None:
            def _set() -> None:
                if fut.done():
                    return
                if isinstance(out, BaseException):
                    fut.set_exception(out)
                else:
                    fut.set_result(out)
            if loop.is_closed():  # the caller gave up (e.g. a failed run cancelled its episodes)
                return
            try:
                loop.call_soon_threadsafe(_set)
            except RuntimeError:  # closed between the check and the call
                pass

        self._enqueue([self._prepare(request, resolve)])
        self._ensure_worker()
        return await fut

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._worker is not None:
            self._worker.join(timeout=10)
            self._worker = None

    # ---------------------------------------------------------------- submission and worker
    def _prepare(self, request: GenerationRequest, on_done) -> RequestState:
        if self._sleep_level:
            raise RuntimeError("the engine is asleep: call wake_up() before generating")
        p = request.params
        validate_request(request, self.spec.vocab_size, self.max_model_len)
        stop_ids = sorted(set(self.eos_token_ids) | set(p.stop_token_ids))
        if len(stop_ids) > self.config.max_stop_ids:
            raise ValueError(f"request {request.request_id}: {len(stop_ids)} stop token ids (eos included) "
                             f"exceed BuiltinEngineConfig.max_stop_ids={self.config.max_stop_ids}")
        if p.stop and self._decode_text is None:
            raise ValueError(f"request {request.request_id}: SamplingParams.stop needs a tokenizer")
        seed = p.seed if p.seed is not None else self._rng.getrandbits(62)
        # top-k / top-p and the repetition penalty take the sampler's filtered (torch) path
        filtered = p.top_p < 1.0 or 0 < p.top_k < self.spec.vocab_size or p.repetition_penalty != 1.0
        return RequestState(request, on_done, seed, stop_ids, filtered)

    def _enqueue(self, states: list[RequestState]) -> None:
        for st in states:
            self._inbox.put(st)
        self._wake.set()

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._closing = False
            self._worker = threading.Thread(target=self._worker_loop, name="rlhfkit-engine", daemon=True)
            self._worker.start()

    def _worker_loop(self) -> None:
        while not self._closing:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            while not self._closing:
                with self._lock:
                    self._drain_inbox()
                    if not self.sched.busy():
                        break
                    self._run_step()

    def _drain_inbox(self) -> None:
        while True:
            try:
                self.sched.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _run_step(self, batch: bool = False) -> None:
        try:
            with torch.inference_mode():
                self._step(batch)
        except BaseException as exc:  # fail every request in flight rather than hang its caller
            self._fail_all(exc)
            raise

    def _fail_all(self, exc: BaseException) -> None:
        self._drain_inbox()
        reqs = {id(s.req): s.req for s in self.sched.running.values()}
        reqs.update({id(r): r for r in self.sched.waiting})
        self.sched = SlotScheduler(self.config.max_num_seqs, self.config.max_prefill_tokens)
        self.state.done.fill_(True)
        for r in reqs.values():
            r.on_done(exc)

    # ---------------------------------------------------------------- one engine step
    def _step(self, batch: bool = False) -> None:
        self._drain_inbox()
        had_running = bool(self.sched.running)
        while True:  # fill every free slot before decoding (one prefill call per token budget)
            admissions = self.sched.plan_admissions()
            if not admissions:
                break
            self.stats.mid_run_admissions += had_running
            self._prefill(admissions)
        steps, quiet = self._decode(batch, hold=self._lookahead)
        if steps and quiet and self._lookahead:
            snap = self._snapshot()  # as of the end of this chunk
            ahead, _ = self._decode(batch, cap=self._lookahead)
            self._sync(snap, ahead)
        else:
            self._sync()
        moves = self.sched.plan_compaction()
        if moves:
            self._move_slots(moves)

    def _prefill(self, admissions: list[Admission]) -> None:
        prompts = [a.req.request.prompt_token_ids for a in admissions]
        plen = max(len(p) for p in prompts)
        padded = np.zeros((len(prompts), plen), dtype=np.int64)  # row by row: 3x faster than torch.tensor(lists)
        for i, p in enumerate(prompts):
            padded[i, :len(p)] = p
        tokens = torch.from_numpy(padded)
        lengths = torch.tensor([len(p) for p in prompts])
        first_slots = [a.slots[0] for a in admissions]
        step = first_slots[1] - first_slots[0] if len(first_slots) > 1 else 1
        evenly = step >= 1 and first_slots == list(range(first_slots[0], first_slots[0] + step * len(first_slots), step))
        first = torch.tensor(first_slots)
        h2d = self._h2d
        logits = self.runner.prefill(self.cache, h2d(tokens), h2d(lengths), h2d(first),
                                     slice(first_slots[0], first_slots[-1] + 1, step) if evenly else None)
        self.stats.prefill_calls += 1
        self.stats.prefill_sequences += len(prompts)
        self.stats.prefill_tokens += int(lengths.sum())
        src = [a.slots[0] for a in admissions for _ in a.slots[1:]]
        dst = [s for a in admissions for s in a.slots[1:]]
        if dst:
            self.cache.copy_rows(h2d(src), h2d(dst), plen)
        slots = [s for a in admissions for s in a.slots]
        row_of = h2d([i for i, a in enumerate(admissions) for _ in a.slots])
        self._init_slots(admissions)
        filtered = any(a.req.filtered for a in admissions)
        self.runner.sample(h2d(slots), logits[row_of], filtered)

    def _init_slots(self, admissions: list[Admission]) -> None:
        """Write the sampling settings and fresh counters of newly admitted slots."""
        st, vocab = self.state, self.spec.vocab_size
        m = self.config.max_stop_ids
        recs = []  # one tuple per slot (columns below): a full batch admits hundreds at once
        for a in admissions:
            p, req = a.req.request.params, a.req
            ids = req.stop_ids or [0]
            const = (req.prompt_len - 1, p.temperature, p.top_p, p.top_k if 0 < p.top_k < vocab else vocab,
                     p.min_new_tokens, p.max_new_tokens, ids + [ids[0]] * (m - len(ids)), [bool(req.stop_ids)] * m)
            for i, slot in enumerate(a.slots):
                recs.append((slot, *const, hash((req.seed, a.first_sample + i)) & (2**63 - 1), p.repetition_penalty))
        h2d = self._h2d
        idx = st.admit(h2d, *(list(c) for c in zip(*recs)))
        penalised = [a for a in admissions if a.req.request.params.repetition_penalty != 1.0]
        if penalised and st.track_seen(vocab):
            self.runner.reset()  # graphs captured before the mask existed do not update it
        if st.seen.shape[1]:
            st.seen[idx] = False
            if penalised:  # each sample slot starts from its prompt's tokens
                rows_, cols = [], []
                for a in penalised:
                    prompt = a.req.request.prompt_token_ids
                    for slot_ in a.slots:
                        rows_.extend([slot_] * len(prompt))
                        cols.extend(prompt)
                st.seen[h2d(rows_), h2d(cols)] = True

    def _decode(self, batch: bool = False, cap: int | None = None, hold: int = 0) -> tuple[int, bool]:
        """Queue the next chunk of decode steps (at most `cap`); returns the number of steps and
        whether the chunk is `quiet`: batch mode (no waiting request, no stop strings) with some row
        that cannot finish by length inside the chunk, so a look-ahead cannot be wasted on lengths.
        `hold`: a batch-mode chunk that would end every row by length stops `hold` steps short (quiet)."""
        running = self.sched.running
        max_len = self.max_model_len
        min_left, min_room, top, filtered, stops, max_left = None, None, 0, False, False, 0
        for seq in running.values():  # one pass: this runs for every sync of a full batch
            req = seq.req
            params = req.request.params
            left = params.max_new_tokens - seq.gen_bound
            bound = req.prompt_len + seq.gen_bound - 1  # seq.pos_bound
            top = max(top, bound)
            filtered = filtered or req.filtered
            stops = stops or bool(params.stop)
            if left > 0:
                min_left = left if min_left is None else min(min_left, left)
                max_left = max(max_left, left)
                if bound < max_len - 1:
                    room = max_len - 1 - bound
                    min_room = room if min_room is None else min(min_room, room)
        if min_left is None:
            return 0, False
        every = self.config.sync_every
        quiet = batch and not stops and not self.sched.waiting and self._inbox.empty()
        if quiet:
            every = self.config.sync_every_batch
        steps = min(every, min_left, cap or every)
        if min_room is not None:
            steps = max(1, min(steps, min_room))
        if quiet and 0 < hold < steps and max_left <= steps:
            steps -= hold
        quiet = quiet and max_left > steps
        kv_len = length_bucket(top + steps, max_len)
        rows = self.sched.decode_rows()
        self.runner.run(rows, kv_len, filtered, steps)
        for seq in running.values():
            seq.gen_bound += steps
        self.stats.decode_steps += steps
        self.stats.decode_row_steps += steps * rows
        return steps, quiet

    def _snapshot(self, wait: bool = False) -> tuple:
        """`SlotState.read_out` of slots 0..max(running), each from its last read column."""
        running = self.sched.running
        reads, width = [0] * (max(running) + 1), 1
        for slot, seq in running.items():
            reads[slot] = seq.read
            width = max(width, seq.gen_bound - seq.read)
        return self.state.read_out(self._h2d(reads), width, wait or self.device.type != "cuda")

    def _sync(self, snap: tuple | None = None, after: int = 0) -> None:
        """Read every running row's new tokens; finish rows that are done. `snap`: a `_snapshot()`
        taken `after` decode steps ago (rows not done then may have advanced since)."""
        running = self.sched.running
        if not running:
            return
        flags, toks, lps, event = snap or self._snapshot(wait=True)
        if event is not None:
            event.synchronize()
        done, gen = flags[0].tolist(), flags[1].tolist()
        toks, lps = toks.tolist(), lps.tolist()
        watch = []
        for slot, seq in running.items():
            g = gen[slot]
            seq.gen_bound = g if done[slot] else g + after
            if g > seq.read:
                seq.tokens += toks[slot][:g - seq.read]
                seq.logprobs += lps[slot][:g - seq.read]
                seq.read = g
            if done[slot] or seq.req.request.params.stop:
                watch.append(slot)
        freed = []
        for slot in watch:
            seq = running[slot]
            if not done[slot]:
                p = seq.req.request.params
                keep, seq.checked_chars = stop_string_cut(seq.tokens, self._decode_text, p.stop, seq.checked_chars,
                                                          p.min_new_tokens)
                if keep is None:
                    continue
            self._finish(self.sched.release(slot), seq.tokens, seq.logprobs)
            freed.append(slot)
        if freed:
            self.state.done[self._h2d(freed)] = True

    def _finish(self, seq, tokens: list[int], logprobs: list[float]) -> None:
        req, p = seq.req, seq.req.request.params
        ids, lps, reason = finish_completion(tokens, logprobs, req.stop_set, p.min_new_tokens, p.stop,
                                             self._decode_text)
        req.completions[seq.sample] = Completion(
            prompt_token_ids=list(req.request.prompt_token_ids), token_ids=ids,
            logprobs=lps if p.logprobs else None, finish_reason=reason, request_id=req.request.request_id)
        self.stats.generated_tokens += len(ids)
        req.remaining -= 1
        if req.remaining == 0:
            req.on_done(list(req.completions))

    def _move_slots(self, moves: list[tuple[int, int]]) -> None:
        src = self._h2d([m[0] for m in moves])
        dst = self._h2d([m[1] for m in moves])
        longest = max(self.sched.running[d].pos_bound + 1 for _, d in moves)
        self.cache.copy_rows(src, dst, min(longest, self.max_model_len))
        self.state.move_rows(src, dst)
        self.state.done[src] = True
        self.stats.slot_moves += len(moves)
