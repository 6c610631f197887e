"""Small pieces shared by the rollout engines: request validation, eos ids, decode fn, counters,
host-to-device copies."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from rlhfkit.types import Completion, GenerationRequest

if TYPE_CHECKING:
    from transformers import GenerationConfig


@dataclass
class EngineStats:
    """Counters an engine keeps (tests read `prefill_sequences` to check prefix sharing)."""

    prefill_calls: int = 0
    prefill_sequences: int = 0
    prefill_tokens: int = 0
    mid_run_admissions: int = 0  # prefill batches admitted while other sequences were decoding
    decode_steps: int = 0
    decode_row_steps: int = 0
    generated_tokens: int = 0
    slot_moves: int = 0
    weight_updates: int = 0
    vision_calls: int = 0  # vision-tower passes (a VLM's pictures; one per prefill with new pictures)
    pictures_encoded: int = 0  # pictures through the vision tower (each cached picture once)


def validate_request(request: GenerationRequest, vocab_size: int, max_model_len: int | None) -> None:
    """Raise ValueError naming the request and the field for settings no engine can honour."""
    p, rid = request.params, request.request_id
    ids = request.prompt_token_ids
    if len(ids) == 0:
        raise ValueError(f"request {rid}: prompt_token_ids is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"request {rid}: prompt token ids must lie in [0, {vocab_size})")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise ValueError(f"request {rid}: prompt of {len(ids)} tokens leaves no room under "
                         f"max_model_len={max_model_len} (raise --max_len / max_model_len)")
    # one cheap test per request first (this runs for every request); messages only on failure
    if not (p.n >= 1 and p.max_new_tokens >= 1 and p.min_new_tokens >= 0 and p.temperature >= 0
            and 0 < p.top_p <= 1 and p.repetition_penalty > 0
            and all(0 <= t < vocab_size for t in p.stop_token_ids)
            and all(isinstance(s, str) and s for s in p.stop)):
        checks = (
            (p.n >= 1, f"n must be >= 1, got {p.n}"),
            (p.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {p.max_new_tokens}"),
            (0 <= p.min_new_tokens, f"min_new_tokens must be >= 0, got {p.min_new_tokens}"),
            (p.temperature >= 0, f"temperature must be >= 0, got {p.temperature}"),
            (0 < p.top_p <= 1, f"top_p must lie in (0, 1], got {p.top_p}"),
            (p.repetition_penalty > 0, f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
            (all(0 <= t < vocab_size for t in p.stop_token_ids), "stop_token_ids must be valid token ids"),
            (all(isinstance(s, str) and s for s in p.stop), "stop must hold non-empty strings"),
        )
        msg = next(m for ok, m in checks if not ok)
        raise ValueError(f"request {rid}: SamplingParams.{msg}")


def to_device(data: Any, dtype: torch.dtype | None = None, *, device: torch.device) -> torch.Tensor:
    """A host list / CPU tensor on `device` without waiting for the GPU: a plain `.to("cuda")` from
    pageable memory synchronises the stream, which would idle the GPU while the host prepares the
    next step; from pinned memory the copy is queued like a kernel."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def eos_ids_of(generation_config: GenerationConfig | None, tokenizer: Any) -> list[int]:
    """eos ids from the model's generation config and the tokenizer (union, sorted); a tokenizer of a
    backend without `eos_token_id` (or a plain decode function) adds none."""
    ids: set[int] = set()
    from_config = generation_config.eos_token_id if generation_config is not None else None
    for src in (from_config, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return sorted(ids)


def make_decode(tokenizer: Any) -> Callable[[Sequence[int]], str] | None:
    """A token-ids -> text function from a tokenizer (or a callable), None without one."""
    if tokenizer is None:
        return None
    if callable(tokenizer) and not hasattr(tokenizer, "decode"):
        return tokenizer
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)


class Waiter:
    """Collects the results of `count` requests completed from any thread."""

    def __init__(self, count: int):
        self._results: list[list[Completion] | BaseException | None] = [None] * count
        self._left = count
        self._lock = threading.Lock()
        self.done = threading.Event()
        if count == 0:
            self.done.set()

    def set(self, i: int, out: list[Completion] | BaseException) -> None:
        with self._lock:
            self._results[i] = out
            self._left -= 1
            if self._left == 0:
                self.done.set()

    def results(self) -> list[list[Completion]]:
        for r in self._results:
            if isinstance(r, BaseException):
                raise r
        return list(self._results)  # type: ignore[arg-type]


class ThreadBatchingAsync:
    """`agenerate` for engines with only a blocking `generate`: the requests that arrive while a
    batch runs are generated together as the next batch, in a worker thread."""

    _pending: list[tuple[GenerationRequest, asyncio.Future]]
    _drainer: asyncio.Task | None

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        raise NotImplementedError

    async def agenerate(self, request: GenerationRequest) -> list[Completion]:
        if not hasattr(self, "_pending"):
            self._pending, self._drainer = [], None
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((request, fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # let concurrent callers enqueue before the batch is cut
            batch, self._pending = self._pending, []
            try:
                outs = await asyncio.to_thread(self.generate, [r for r, _ in batch])
            except Exception as exc:  # noqa: BLE001 - handed to every waiting caller
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), o in zip(batch, outs):
                if not fut.done():
                    fut.set_result(o)


class EngineSleep:
    """An in-process engine's generation memory freed while the models train (the trainers' EngineMemory;
    train_ppo --vllm_enable_sleep): `sleep(level)` after a rollout, `wake_up()` before the next generation.
    Level 1 frees the KV cache (and decode graphs); level 2 also moves the engine's own copy of the weights
    to the host, which an engine serving the policy's weights must not do."""

    def __init__(self, engine: Any, level: int) -> None:
        self.engine, self.level = engine, level
        self.asleep = False

    def release(self) -> None:
        if not self.asleep:
            self.engine.sleep(self.level)
            self.asleep = True

    def restore(self) -> None:
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False
