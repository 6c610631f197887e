"""HTTP reward-model server (OpenRLHF's `serve_rm` protocol), FastAPI + uvicorn (the `serve` extra).

    python -m rlhfkit.cli.serve_rm --reward_pretrain PATH --port 5000 --max_len 2048 --batch_size 16 \\
        [--normalize_reward] [--value_head_prefix score] [--host 127.0.0.1] [--max_body_mb 32]

    POST /get_reward  {"query": [str], "prompts"?: [str], "labels"?: [any]}
                  ->  {"rewards": [float], "scores": [float], "extra_logs": {"raw_reward": [float]}}
    GET  /health      {"status": "ok", ...}

Data flow. Each request is tokenised (no special tokens added: queries are decoded with them) and
queued; one micro-batcher task merges queued sequences into forwards of at most --batch_size
sequences that run on a worker thread, off the event loop. Requests queue up while a forward runs;
before a forward that is not full the batcher waits up to --batch_wait_ms, but only for requests
already being read or tokenised (a lone client never waits):

    request A (3 seqs) --+
    request B (1 seq)  --+--> queue --> [A0 A1 A2 B0] --thread--> model --> scores --> A, B answered

`rewards` are the reward model's scores, normalised as (r - mean) / std with --normalize_reward
(mean/std from the model's config.json); `scores` equal `rewards`; `extra_logs.raw_reward` holds
the scores before normalisation. `prompts` and `labels` are validated but not used.

Errors answer JSON `{"error": ...}` and the server keeps serving: 400 malformed JSON, missing
`query`, wrong types or lengths; 413 body larger than --max_body_mb; 422 a query that is empty or
longer than --max_len tokens (we reject rather than truncate, unlike OpenRLHF, which silently
cuts the end of the text: a reward for a cut text is not the reward of the text); 500 a model error.

Differences from OpenRLHF: binds 127.0.0.1 unless --host says otherwise (OpenRLHF: 0.0.0.0);
--batch_size defaults to 16 (OpenRLHF: the whole request in one batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from rlhfkit.config.flags import FlagParser

logger = logging.getLogger("rlhfkit.serve_rm")


def build_parser() -> FlagParser:
    p = FlagParser("serve_rm", "Serve a reward model over HTTP (OpenRLHF protocol).")
    p.flag("--reward_pretrain", "--reward.model_name_or_path", type=str, default=None,
           help="reward model directory (saved by train_rm, or any sequence-classification model)")
    p.flag("--normalize_reward", "--reward.normalize_enable", action="store_true",
           help="answer (r - mean) / std with mean/std from the model's config.json")
    p.flag("--value_head_prefix", "--ds.value_head_prefix", type=str, default="score")
    p.flag("--max_len", "--data.max_len", type=int, default=2048, help="longest query in tokens (longer: 422)")
    p.flag("--batch_size", type=int, default=16, help="most sequences per forward")
    p.flag("--batch_wait_ms", type=float, default=5.0,
           help="longest wait for requests being read/tokenised before a forward that is not full")
    p.flag("--port", type=int, default=5000)
    p.flag("--host", type=str, default="127.0.0.1", help="bind address (0.0.0.0 to accept remote clients)")
    p.flag("--max_body_mb", type=float, default=32.0, help="largest request body (larger: 413)")
    p.flag("--param_dtype", "--ds.param_dtype", type=str, default="bf16", choices=["bf16", "fp16", "fp32"])
    p.flag("--bf16", dest="param_dtype", action="store_const", const="bf16", help="alias of --param_dtype bf16")
    p.flag("--attn_implementation", "--ds.attn_implementation", type=str, default="sdpa")
    p.flag("--flash_attn", dest="attn_implementation", action="store_const", const="flash_attention_2")
    p.flag("--load_in_4bit", "--ds.load_in_4bit", action="store_true")
    p.flag("--disable_fast_tokenizer", "--data.disable_fast_tokenizer", action="store_true")
    p.flag("--packing_samples", "--ds.packing_samples", action="store_true",
           help="accepted for OpenRLHF command-line compatibility; batches are padded")
    p.flag("--device", type=str, default=None, help="cpu or cuda (default: cuda when available)")
    p.flag("--num_threads", type=int, default=0,
           help="torch CPU threads for the model (0: torch's default); 1 avoids stalls on a busy CPU")
    p.flag("--log_level", type=str, default="warning", choices=["debug", "info", "warning", "error"])
    return p


@dataclass
class ServeConfig:
    reward_pretrain: str
    max_len: int = 2048
    batch_size: int = 16
    batch_wait_ms: float = 5.0
    normalize_reward: bool = False
    value_head_prefix: str = "score"
    param_dtype: str = "bf16"
    attn_implementation: str = "sdpa"
    load_in_4bit: bool = False
    disable_fast_tokenizer: bool = False
    device: str | None = None
    max_body_mb: float = 32.0

    def __post_init__(self) -> None:
        for name in ("max_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0 or self.max_body_mb <= 0:
            raise ValueError("--batch_wait_ms must be >= 0 and --max_body_mb > 0")


class RequestError(Exception):
    """A client error: answered with `status` and a JSON {"error": message}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ----------------------------------------------------------------------------- model


class RewardScorer:
    """Tokenizer + reward model; `score` runs one padded forward (called from one worker thread)."""

    def __init__(self, cfg: ServeConfig) -> None:
        from rlhfkit.config.configs import ModelConfig
        from rlhfkit.models.loader import load_tokenizer
        from rlhfkit.models.value import load_value_model, reward_settings

        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = load_tokenizer(cfg.reward_pretrain, padding_side="right",
                                        use_fast=not cfg.disable_fast_tokenizer, flag="--reward_pretrain")
        mcfg = ModelConfig(param_dtype=cfg.param_dtype, attn_implementation=cfg.attn_implementation,
                           load_in_4bit=cfg.load_in_4bit, lora_rank=0)
        # Loaded un-normalised: the raw score goes to extra_logs, the normalised one to rewards.
        self.model = load_value_model(cfg.reward_pretrain, value_head_prefix=cfg.value_head_prefix,
                                      dtype=cfg.param_dtype, device=self.device, cfg=mcfg,
                                      flag="--reward_pretrain").eval()
        if cfg.load_in_4bit:  # bitsandbytes placed it already; make sure we feed the same device
            self.device = next(self.model.parameters()).device
        mc = self.model.config
        self.mean, self.std = float(mc.mean), float(mc.std)
        if cfg.normalize_reward:
            stored = reward_settings(cfg.reward_pretrain)
            if stored.get("mean") is None or stored.get("std") is None:
                logger.warning("--normalize_reward: %s/config.json stores no reward mean/std; rewards are "
                               "(r - 0) / 1", cfg.reward_pretrain)
            if not self.std > 0:
                raise ValueError(f"--normalize_reward: std={self.std} in {cfg.reward_pretrain}/config.json")
        self.pad_id = self.tokenizer.pad_token_id

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids; raises RequestError(422) for empty or too-long texts."""
        ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        for i, row in enumerate(ids):
            if not row:
                raise RequestError(422, f"query[{i}] is empty (no tokens to score)")
            if len(row) > self.cfg.max_len:
                raise RequestError(422, f"query[{i}] has {len(row)} tokens, more than --max_len {self.cfg.max_len}")
        return ids

    @torch.inference_mode()
    def score(self, batch: list[list[int]]) -> list[float]:
        """Raw scores (value at the last token) of right-padded sequences."""
        from rlhfkit.models.value import reward_at_last_token

        width = max(len(r) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        values = self.model(input_ids=ids, attention_mask=mask)
        return reward_at_last_token(values, mask).float().cpu().tolist()

    def normalise(self, raw: list[float]) -> list[float]:
        if not self.cfg.normalize_reward:
            return list(raw)
        return [(r - self.mean) / self.std for r in raw]


# ----------------------------------------------------------------------------- micro-batcher


@dataclass
class _Job:
    ids: list[list[int]]
    future: asyncio.Future
    out: list[float] = field(default_factory=list)
    scheduled: int = 0  # sequences handed to a forward so far
    scored: int = 0

    def __post_init__(self) -> None:
        self.out = [0.0] * len(self.ids)


class MicroBatcher:
    """Merge queued requests into forwards of at most `batch_size` sequences.

    Whatever is queued when the model becomes free goes into the next forward (requests pile up
    while a forward runs, so batches grow with load). Before a forward that is not full, the
    batcher waits up to `wait_s` for more, but only while requests are being read and tokenised
    (`announce()`), so a lone client never waits.
    """

    def __init__(self, score_fn: Callable[[list[list[int]]], list[float]], batch_size: int, wait_s: float) -> None:
        self.score_fn, self.batch_size, self.wait_s = score_fn, batch_size, wait_s
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve_rm-model")
        self.incoming = 0  # requests being read / tokenised, about to be submitted
        self.forwards = 0
        self.sequences = 0

    @contextmanager
    def announce(self) -> Iterator[None]:
        """Mark a request as on its way to `submit` (the batcher may wait for it)."""
        self.incoming += 1
        try:
            yield
        finally:
            self.incoming -= 1

    async def submit(self, ids: list[list[int]]) -> list[float]:
        if not ids:
            return []
        job = _Job(ids, asyncio.get_running_loop().create_future())
        await self.queue.put(job)
        return await job.future

    @staticmethod
    def _unscheduled(active: deque[_Job]) -> int:
        return sum(len(j.ids) - j.scheduled for j in active)

    async def _gather(self, active: deque[_Job]) -> None:
        """Wait for a first job, then add queued jobs until the batch is full, nothing more is on its
        way, or the wait is over."""
        if not active:
            active.append(await self.queue.get())
        deadline = asyncio.get_running_loop().time() + self.wait_s
        while self._unscheduled(active) < self.batch_size:
            if not self.queue.empty():
                active.append(self.queue.get_nowait())
                continue
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0 or self.incoming == 0:
                break
            try:
                active.append(await asyncio.wait_for(self.queue.get(), remaining))
            except asyncio.TimeoutError:
                break

    def _take(self, active: deque[_Job]) -> list[tuple[_Job, int]]:
        batch: list[tuple[_Job, int]] = []
        for job in active:
            while job.scheduled < len(job.ids) and len(batch) < self.batch_size:
                batch.append((job, job.scheduled))
                job.scheduled += 1
        return batch

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        active: deque[_Job] = deque()
        while True:
            await self._gather(active)
            batch = self._take(active)
            try:
                scores = await loop.run_in_executor(self.executor, self.score_fn, [j.ids[i] for j, i in batch])
            except Exception as e:  # the model failed: fail these requests, keep serving
                logger.exception("reward model forward failed")
                for job in {id(j): j for j, _ in batch}.values():
                    if not job.future.done():
                        job.future.set_exception(RequestError(500, f"reward model failed: {type(e).__name__}: {e}"))
                    active.remove(job)
                continue
            self.forwards += 1
            self.sequences += len(batch)
            for (job, i), s in zip(batch, scores):
                job.out[i] = s
                job.scored += 1
            for job in [j for j in active if j.scored == len(j.ids)]:
                active.remove(job)
                if not job.future.done():  # the client may have gone away
                    job.future.set_result(job.out)


# ----------------------------------------------------------------------------- HTTP


def parse_request(body: bytes) -> tuple[list[str], list[Any] | None, list[Any] | None]:
    """Validate a /get_reward body -> (query, prompts, labels); RequestError(400) when malformed."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object with 'query', got {type(data).__name__}")
    if "query" not in data:
        raise RequestError(400, "missing field 'query' (a list of prompt+response strings)")
    query = data["query"]
    if not isinstance(query, list) or not all(isinstance(q, str) for q in query):
        raise RequestError(400, "'query' must be a list of strings")
    extra = []
    for name in ("prompts", "labels"):
        value = data.get(name)
        if value is not None and not isinstance(value, list):
            raise RequestError(400, f"'{name}' must be a list")
        if value is not None and len(value) not in (0, len(query)):
            raise RequestError(400, f"'{name}' has {len(value)} entries for {len(query)} queries")
        extra.append(value)
    return query, extra[0], extra[1]


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, or RequestError(413) once it exceeds `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {declared} bytes exceeds --max_body_mb ({limit} bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body exceeds --max_body_mb ({limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _fastapi() -> Any:
    try:
        import fastapi
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError("serve_rm needs fastapi and uvicorn: pip install 'rlhfkit[serve]'") from None
    return fastapi


def create_app(scorer: RewardScorer, cfg: ServeConfig) -> Any:
    """The FastAPI app; the micro-batcher runs as a task for the app's lifetime."""
    fastapi = _fastapi()
    from contextlib import asynccontextmanager

    from fastapi.responses import JSONResponse

    batcher = MicroBatcher(scorer.score, cfg.batch_size, cfg.batch_wait_ms / 1000.0)
    # one tokenizer thread: a tokenizer is not meant to be used from several threads at once
    tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve_rm-tokenize")
    limit = int(cfg.max_body_mb * 1024 * 1024)

    @asynccontextmanager
    async def lifespan(app: Any):  # type: ignore[no-untyped-def]
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.executor.shutdown(wait=False)
        tokenize_pool.shutdown(wait=False)

    app = fastapi.FastAPI(title="rlhfkit serve_rm", lifespan=lifespan)
    app.state.batcher = batcher

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": cfg.reward_pretrain, "max_len": cfg.max_len,
                "batch_size": cfg.batch_size, "normalize_reward": cfg.normalize_reward,
                "forwards": batcher.forwards, "sequences": batcher.sequences}

    async def get_reward(request: Any) -> Any:  # a plain Starlette route: it reads the raw body itself
        try:
            with batcher.announce():
                query, _prompts, _labels = parse_request(await read_body(request, limit))
                loop = asyncio.get_running_loop()
                ids = await loop.run_in_executor(tokenize_pool, scorer.tokenize, query) if query else []
            raw = await batcher.submit(ids)
        except RequestError as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)
        rewards = scorer.normalise(raw)
        return JSONResponse({"rewards": rewards, "scores": rewards, "extra_logs": {"raw_reward": raw}})

    app.add_route("/get_reward", get_reward, methods=["POST"])

    @app.exception_handler(Exception)
    async def on_error(request: Any, exc: Exception) -> Any:
        logger.exception("unhandled error")
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    return app


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    if not args.reward_pretrain:
        raise SystemExit("serve_rm: error: --reward_pretrain is required (a reward model directory)")
    fields = ServeConfig.__dataclass_fields__
    return ServeConfig(**{k: getattr(args, k) for k in fields if hasattr(args, k)})


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(args)
    _fastapi()
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    import uvicorn

    t0 = time.time()
    scorer = RewardScorer(cfg)
    app = create_app(scorer, cfg)
    print(f"serve_rm: {cfg.reward_pretrain} loaded in {time.time() - t0:.1f} s on {scorer.device}; "
          f"listening on http://{args.host}:{args.port}/get_reward", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
