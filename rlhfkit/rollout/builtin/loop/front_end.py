"""BuiltinEngine: the fast rollout engine (RolloutEngine protocol) for the HF families of model/families.py.

One engine step (`EngineLoop.step`, under the engine lock; loop/engine_loop.py):

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
round trip with the GPU idle. There, while a
row may still run by length, the sync looks ahead: flags and lengths are copied without blocking
after the chunk and `lookahead_steps` more steps are queued before the host reads them, so the GPU
does not wait for the host (done rows are frozen; all rows done: those steps are wasted). `generate()` drives steps in the caller's
thread; `agenerate()` hands the request to a background thread that steps while any work is
pending, so concurrent agent episodes share one batch. Woken while idle, that thread first waits
until requests stop arriving (`admit_window_ms`, loop/inbox.py): an RL step's episodes submit one by one,
and without the wait the first group decoded a chunk alone and the rest joined it mid-run.

Device work goes through `self.steps` (loop/step_runner.py): the front end here plans, the step runner
prefills, decodes and reads back. With `tp` (a `TensorParallelGroup` of N shards) the engine is
tensor-parallel: shard 0 runs this front end and mirrors every step operation to shards 1..N-1,
which run `serve()` until `close()`; each shard holds 1/N of the heads, MLP and vocab (model/spec.py).

Memory: the KV cache is preallocated, 2 x layers x max_num_seqs x kv_heads x max_model_len x
head_dim elements (per shard: its KV heads); `sleep()` frees it (and the decode graphs, keeping
the compiled step), `wake_up()` reallocates it.

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a request's `images` go through the
model's vision tower once per picture (cached by content key, so the n samples of a prompt share
it), their features are spliced into the prompt's placeholder run at prefill, with the prompt's
3-D rotary positions shifted so that decoding stays ordinary 1-D RoPE (model/vision.py). The vision
markers are never sampled (`banned`); reported log-probs are those of the unmasked distribution.

Weight updates with requests in flight (partial rollout, as vLLM's `pause_generation(mode="keep")`):
weights change only between engine steps (`update_weights` takes the engine lock), so a sequence
keeps its slot and KV cache across an update and continues with the new weights. `pause()` stops
stepping at the next step boundary (requests keep arriving and wait), so that an update made of
several calls (one per weight bucket) lands whole; `resume(version)` continues. Every sample
records the policy version of each token it generated (`Completion.policy_versions`): the version
when it was admitted, then a new span wherever an update happened (`Sequence.mark_version`); a
token's log-prob is always that of the weights that sampled it. `update_weights` counts versions
itself (+1 per call); a weight sync that loads buckets through `update_weights_local` sets the
version with `resume(version)` / `set_policy_version(version)`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from typing import Any, Iterable

import torch

from rlhfkit.models.vlm import is_vision_name, placeholder_runs
from rlhfkit.rollout.builtin.config import BuiltinEngineConfig
from rlhfkit.rollout.builtin.loop.engine_loop import EngineLoop
from rlhfkit.rollout.builtin.loop.inbox import Inbox
from rlhfkit.rollout.builtin.loop.mirror import mirror
from rlhfkit.rollout.builtin.loop.scheduler import RequestState, SlotScheduler, batch_bucket, length_bucket
from rlhfkit.rollout.builtin.loop.step_runner import StepRunner
from rlhfkit.rollout.builtin.model.decoder import DecoderModel, resolve_decode_attention, resolve_decode_gemm
from rlhfkit.rollout.builtin.model.rope import rope_inv_freq, rope_table_set
from rlhfkit.rollout.builtin.model.tensor_parallel import TensorParallelGroup, load_weights
from rlhfkit.rollout.builtin.model.vision import VisionIndex, load_vision_tower
from rlhfkit.rollout.engine_utils import EngineStats, Waiter, eos_ids_of, make_decode, validate_request
from rlhfkit.types import Completion, GenerationRequest

log = logging.getLogger(__name__)


class BuiltinEngine:
    """Continuous-batching engine over its own copy of an HF model's weights.

    `model`: an HF `*ForCausalLM` module, or a model directory (read tensor by tensor from its
    safetensors files, each shard reading only its slices). `tp`: this process's shard of a
    tensor-parallel engine (shard 0 serves requests; the others call `serve()`). `share_weights`
    (a module, one shard): the module's parameters become views of the engine's weights wherever they
    fit, one copy for both (a trainer's in-place optimizer step is what the engine serves next;
    `shared_names` lists them, and `sleep(2)` is refused).

    Example:
        engine = BuiltinEngine(hf_model, tokenizer, device="cuda", dtype=torch.bfloat16)
        [[c]] = engine.generate([GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=8))])
    """

    def __init__(self, model: torch.nn.Module | str, tokenizer: Any = None, *,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 config: BuiltinEngineConfig | None = None, eos_token_ids: list[int] | None = None,
                 tp: TensorParallelGroup | None = None, share_weights: bool = False):
        self.config = config or BuiltinEngineConfig()
        self.config.validate()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.tokenizer = tokenizer
        decode_text = make_decode(tokenizer)
        self._decode_text = decode_text
        hf_config, generation_config, self.dtype, self.spec, weights, shared = load_weights(
            model, dtype, self.device, self.tp, share=share_weights)
        # the HF names whose tensors the module and the engine share (share_weights): a weight sync skips them
        self.shared_names: frozenset[str] = shared
        self.eos_token_ids = (eos_ids_of(generation_config, tokenizer) if eos_token_ids is None
                              else list(eos_token_ids))
        cfg = self.config
        self.max_model_len = cfg.max_model_len or min(self.spec.max_position_embeddings, 2048)
        tables = rope_table_set(hf_config, self.spec, self.max_model_len, self.dtype, self.device)
        tower = load_vision_tower(model, hf_config, self.dtype, self.device)
        self.vision_layout = tower.layout if tower is not None else None
        self.banned = tower.layout.special_ids if tower is not None else ()
        self._vision_index = VisionIndex(tower.layout, cfg.vision_cache_pictures) if tower is not None else None
        inv_freq, rope_scaling = rope_inv_freq(hf_config, self.spec)
        attn = resolve_decode_attention(cfg.decode_attention, self.spec, self.device)
        gemm = resolve_decode_gemm(cfg.decode_gemm, self.spec, weights, self.device)
        on_cuda = self.device.type == "cuda"
        graphs = on_cuda if cfg.cuda_graphs is None else cfg.cuda_graphs
        compile_step = bool(cfg.compile)
        lookahead = (4 if on_cuda else 0) if cfg.lookahead_steps is None else cfg.lookahead_steps
        if graphs and not on_cuda:
            raise ValueError("BuiltinEngineConfig.cuda_graphs needs a CUDA device")
        self._local = StepRunner(
            DecoderModel(self.spec, weights, *tables[0], attn, gemm, cfg.gemm_min_rows, tables=tables),
            num_slots=cfg.max_num_seqs, max_model_len=self.max_model_len, max_stop_ids=cfg.max_stop_ids,
            device=self.device, dtype=self.dtype, cuda_graphs=graphs, compile_step=compile_step,
            compile_prefill=compile_step if cfg.compile_prefill is None else cfg.compile_prefill,
            compile_mode=cfg.compile_mode, fast_sampling=cfg.fast_sampling, vision=tower,
            inv_freq=inv_freq, rope_scaling=rope_scaling)
        self.steps = mirror(self._local, self.tp)
        self.stats = EngineStats()
        self._rng = random.Random(cfg.seed)  # seeds of requests without one (host side: no torch op per request)
        self._lock = threading.RLock()
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._inbox = Inbox()
        self._worker: threading.Thread | None = None
        self._closing = False
        self._closed = False
        self.loop = EngineLoop(self.steps, cfg, self._inbox, self.stats, vocab_size=self.spec.vocab_size,
                               max_model_len=self.max_model_len, lookahead=lookahead, banned=self.banned,
                               vision_index=self._vision_index, decode_text=decode_text)

    @property
    def sched(self) -> SlotScheduler:
        return self.loop.sched

    @property
    def policy_version(self) -> int:
        """The version of the weights now loaded (see the module docstring)."""
        return self.loop.version

    # ---------------------------------------------------------------- the device side (loop/step_runner.py)
    @property
    def runner(self):
        return self._local.runner

    @property
    def model(self) -> DecoderModel:
        return self._local.model

    @property
    def cache(self):
        return self._local.cache

    @property
    def state(self):
        return self._local.state

    def serve(self) -> int:
        """Shards 1..N-1 of a tensor-parallel engine: run shard 0's step operations until it closes."""
        from rlhfkit.rollout.builtin.loop.mirror import serve

        if self.tp is None or self.tp.rank == 0:
            raise RuntimeError("BuiltinEngine.serve() is for shards 1..N-1 of a tensor-parallel engine")
        return serve(self._local, self.tp.control_channel)

    def _front_end(self, what: str) -> None:
        if self.tp is not None and self.tp.rank != 0:
            raise RuntimeError(f"BuiltinEngine.{what}() runs on shard 0 of a tensor-parallel engine; "
                               f"shard {self.tp.rank} runs serve()")

    # ---------------------------------------------------------------- memory
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and decode graphs (level 1); level 2 also moves the weights to CPU."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if level == 2 and self.shared_names:
            raise ValueError("sleep level 2 would move the weights the engine shares with the policy to the CPU; "
                             "level 1 frees the KV cache")
        self._front_end("sleep")
        with self._lock:
            self._drain_inbox()
            if self.sched.busy():
                raise RuntimeError("BuiltinEngine.sleep() called with requests in flight")
            if not self._local.asleep:
                self.steps.sleep(level)
                if self._vision_index is not None:
                    self._vision_index.clear()  # the shards' vision caches were emptied with it

    def wake_up(self) -> None:
        self._front_end("wake_up")
        with self._lock:
            if self._local.asleep:
                self.steps.wake_up()

    @property
    def _sleep_level(self) -> int:
        return self._local.asleep

    def warmup(self, num_rows: int | None = None, filtered: bool = False) -> None:
        """Compile / capture the decode step for `num_rows` rows (default: all slots) at every KV
        length bucket up to max_model_len, so that no capture happens while generating."""
        self._front_end("warmup")
        lens: list[int] = []
        n = 1
        while not lens or lens[-1] < self.max_model_len:
            lens.append(length_bucket(n, self.max_model_len))
            n = lens[-1] + 1
        rows = batch_bucket(num_rows or self.config.max_num_seqs, self.config.max_num_seqs)
        with self._lock:
            if self.sched.busy():
                raise RuntimeError("BuiltinEngine.warmup() needs an idle engine")
            self.steps.warmup(rows, lens, filtered)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the engine's weights in place (graphs stay valid); a
        tensor-parallel engine sends them to every shard, each keeping its slice. Runs between
        engine steps: requests in flight continue with the new weights (policy version + 1)."""
        self._front_end("update_weights")
        with self._lock:
            named_tensors = self._note_vision_update(named_tensors)
            self.steps.update_weights(named_tensors)
            self.stats.weight_updates += 1
            self.set_policy_version(self.policy_version + 1)

    def _note_vision_update(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """A VLM's front end forgets its picture index when vision-tower weights arrive (the shards'
        towers empty their caches as they load them)."""
        if self._vision_index is None:
            return named
        named = list(named)
        if any(is_vision_name(n.removeprefix("module.")) for n, _ in named):
            self._vision_index.clear()
        return named

    def update_weights_local(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """This shard's slices of full HF-named tensors (each shard of a tensor-parallel engine gets
        the same tensors from the weight sync itself); returns the number of names loaded. One
        call per bucket, between engine steps; the caller sets the version when all are loaded."""
        with self._lock:
            if self.tp is None or self.tp.rank == 0:
                named_tensors = self._note_vision_update(named_tensors)
            n = self._local.update_weights(named_tensors)
            if self.tp is None or self.tp.rank == 0:
                self.stats.weight_updates += 1
            return n

    # ---------------------------------------------------------------- partial rollout
    def pause(self) -> None:
        """Stop stepping at the next step boundary; returns once no step runs. Requests in flight
        keep their slots and KV cache; new ones wait. `resume()` continues."""
        self._front_end("pause")
        with self._lock:
            self._running.clear()

    def resume(self, version: int | None = None) -> None:
        """Continue stepping; tokens from now on carry policy `version` (when given)."""
        self._front_end("resume")
        with self._lock:
            if version is not None:
                self.set_policy_version(version)
            self._running.set()
        self._inbox.wake()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def set_policy_version(self, version: int) -> None:
        """The policy version of the loaded weights: every running sample's next token starts a
        span of `version` (requests admitted later start with it)."""
        with self._lock:
            self.loop.version = int(version)
            for seq in self.sched.running.values():
                seq.mark_version(self.loop.version)

    # ---------------------------------------------------------------- public generation API
    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        waiter = Waiter(len(requests))
        states = [self._prepare(req, lambda out, i=i: waiter.set(i, out)) for i, req in enumerate(requests)]
        self._enqueue(states)
        while not waiter.done.is_set():
            self._running.wait(timeout=1.0)  # paused: wait outside the lock for resume()
            with self._lock:
                if waiter.done.is_set():
                    break
                if self._running.is_set():
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
        self._running.set()
        self._inbox.wake()
        if self._worker is not None:
            self._worker.join(timeout=10)
            self._worker = None
        if self.tp is not None and self.tp.rank == 0 and not self._closed:
            self.steps.shutdown()  # ends the other shards' serve()
        self._closed = True

    # ---------------------------------------------------------------- submission and worker
    def _prepare(self, request: GenerationRequest, on_done) -> RequestState:
        self._front_end("generate")
        if self._sleep_level:
            raise RuntimeError("the engine is asleep: call wake_up() before generating")
        p = request.params
        validate_request(request, self.spec.vocab_size, self.max_model_len)
        self._check_pictures(request)
        stop_ids = sorted(set(self.eos_token_ids) | set(p.stop_token_ids))
        if len(set(stop_ids) | set(self.banned)) > self.config.max_stop_ids:
            raise ValueError(f"request {request.request_id}: {len(stop_ids)} stop token ids (eos included) and "
                             f"{len(self.banned)} vision markers exceed BuiltinEngineConfig.max_stop_ids="
                             f"{self.config.max_stop_ids}")
        if p.stop and self._decode_text is None:
            raise ValueError(f"request {request.request_id}: SamplingParams.stop needs a tokenizer")
        seed = p.seed if p.seed is not None else self._rng.getrandbits(62)
        # top-k / top-p and the repetition penalty take the sampler's filtered (torch) path
        filtered = p.top_p < 1.0 or 0 < p.top_k < self.spec.vocab_size or p.repetition_penalty != 1.0
        return RequestState(request, on_done, seed, stop_ids, filtered)

    def _check_pictures(self, request: GenerationRequest) -> None:
        """A request's pictures must match its placeholder runs; a text model takes none."""
        has = request.images is not None and len(request.images) > 0
        if self.vision_layout is None:
            if has:
                raise ValueError(f"request {request.request_id}: pictures for a model without a vision tower")
            return
        placeholder_runs(request.prompt_token_ids, request.images, self.vision_layout,
                         f"request {request.request_id}")

    def _enqueue(self, states: list[RequestState]) -> None:
        self._inbox.put(states)

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._closing = False
            self._worker = threading.Thread(target=self._worker_loop, name="rlhfkit-engine", daemon=True)
            self._worker.start()

    def _worker_loop(self) -> None:
        while not self._closing:
            self._inbox.wait(timeout=1.0)
            if not self.sched.busy():  # idle: let the rest of a burst arrive (config.admit_window_ms)
                self._inbox.gather_burst(self.config.admit_window_ms / 1000.0, lambda: self._closing)
            while not self._closing:
                with self._lock:
                    self._drain_inbox()
                    if not self.sched.busy() or not self._running.is_set():
                        break  # idle, or paused: resume() wakes this loop
                    self._run_step()

    def expect_requests(self, n: int) -> None:
        """A hint: `n` agenerate() calls are about to come (an RL step's episodes); an idle engine
        starts once they are all in rather than with the first ones (admit_window_ms > 0)."""
        self._inbox.expect(n)

    def _drain_inbox(self) -> None:
        self.loop.drain_inbox()

    def _run_step(self, batch: bool = False) -> None:
        try:
            with torch.inference_mode():
                self.loop.step(batch)
        except BaseException as exc:  # fail every request in flight rather than hang its caller
            self._fail_all(exc)
            raise

    def _fail_all(self, exc: BaseException) -> None:
        for r in self.loop.reset():
            r.on_done(exc)
