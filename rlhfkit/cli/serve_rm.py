"""HTTP reward-model server (OpenRLHF's `serve_rm` protocol), FastAPI + uvicorn (the `serve` extra).

    python -m rlhfkit.cli.serve_rm --reward_pretrain PATH --port 5000 --max_len 2048 --batch_size 16 \\
        [--normalize_reward] [--value_head_prefix score] [--host 127.0.0.1] [--max_body_mb 32]

    POST /get_reward  {"query": [str], "prompts"?: [str], "labels"?: [any]}
                  ->  {"rewards": [float], "scores": [float], "extra_logs": {"raw_reward": [float]}}
    GET  /health      {"status": "ok", "forwards": ..., "sequences": ..., "cancelled": ..., ...}

Data flow. A request's body is read under --read_timeout_s and --max_body_mb and parsed under the
item, character and depth limits (`serving/request.py`) before anything is tokenised; its queries then
join the round-robin scheduler (`serving/batcher.py`), which hands one worker thread micro-batches of
at most --batch_size queries taken in turn from every pending request; the thread tokenises and scores
each micro-batch. A small request is therefore answered after a forward or two even behind a huge one,
and a request whose client disconnects loses its queries not yet scored:

    request A (10k) --read, parse-->+
    request B (1)   --read, parse-->+--> round robin --> [A0 B0 A1 .. A14] --thread--> tokenise, model
                                                          B answered; A's next micro-batches follow

`rewards` are the reward model's scores, normalised as (r - mean) / std with --normalize_reward
(mean/std from the model's config.json); `scores` equal `rewards`; `extra_logs.raw_reward` holds
the scores before normalisation. `prompts` and `labels` are validated but not used.

Errors answer JSON `{"error": ...}` and the server keeps serving: 400 malformed input (not UTF-8, not
JSON, lone surrogates, missing `query`, wrong types or lengths); 408 a body not received within
--read_timeout_s; 413 a body larger than --max_body_mb; 422 a limit (--max_queries, --max_query_chars,
--max_json_depth) or a query that is empty or longer than --max_len tokens (we reject rather than
truncate, unlike OpenRLHF, which silently cuts the end of the text: a reward for a cut text is not the
reward of the text); 500 a model error. A 408 or 413 also closes the connection. A connection whose
request headers do not arrive within --read_timeout_s is closed; an oversized body is read through
before its 413 so the client gets the answer, not a reset; input that is not HTTP gets a JSON 400 too.
The port is bound before the model loads: a busy one ends the server in one line before anything says
it listens. SIGTERM stops accepting connections,
lets requests in progress finish for up to --shutdown_timeout_s, then cancels them and exits.

Threads (--num_threads 0, the default): on CPU the model gets one torch thread per core but one, and
the tokenizer runs single-threaded (TOKENIZERS_PARALLELISM=false unless set), leaving a core to the
event loop that reads, parses and answers requests: with torch's default (a thread per core) its
spinning OpenMP workers starve the event loop under many clients (64 clients on 2 cores: 10.7
requests/s against 77.6 with one thread, issue 14). On GPU torch's default is kept.

Memory: requests are parsed from their text without building more than the text itself, queries are
tokenised one micro-batch at a time, all threads share one glibc malloc arena, and after a body of
1 MB or more the C heap is trimmed (`malloc_trim`), so a rejected 30 MB request leaves the process near
its baseline size.

Differences from OpenRLHF: binds 127.0.0.1 unless --host says otherwise (OpenRLHF: 0.0.0.0);
--batch_size defaults to 16 (OpenRLHF: the whole request in one batch); the limits above (OpenRLHF has
none).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import gc
import logging
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlhfkit.serving.batcher import FairBatcher, Rejected
from rlhfkit.serving.request import (ClientGone, RequestError, RequestLimits, header_timeout_protocol,
                                          parse_or_error, read_body)
from rlhfkit.config.configs import from_args
from rlhfkit.config.flags import (FlagParser, add_attn_flags, add_device_flag, add_dtype_flags, add_experts_flag,
                                  add_fast_tokenizer_flag, add_load_in_4bit_flag, add_max_len_flag,
                                  add_normalize_reward_flag, add_packing_flag, add_reward_model_flag,
                                  add_use_ms_flag, add_value_head_flag)

logger = logging.getLogger("rlhfkit.serve_rm")
TRIM_AFTER_BYTES = 1 << 20  # trim the C heap after bodies this large


def build_parser() -> FlagParser:
    p = FlagParser("serve_rm", "Serve a reward model over HTTP (OpenRLHF protocol).", own_logging=True)
    p.set_defaults(log_level="warning")
    with p.group("reward model"):
        add_reward_model_flag(p, "reward model directory or hub id (saved by train_rm, or any sequence-classification "
                                 "model)")
        add_normalize_reward_flag(p, "answer (r - mean) / std with mean/std from the model's config.json")
        add_value_head_flag(p, "name of the model's value head module")
        add_max_len_flag(p, "longest query in tokens (longer: 422)")
    with p.group("server"):
        p.flag("--batch_size", type=int, default=16, help="most sequences per forward")
        p.flag("--batch_wait_ms", type=float, default=5.0,
               help="longest wait for requests being read/parsed before a forward that is not full")
        p.flag("--port", type=int, default=5000, help="TCP port to listen on")
        p.flag("--host", type=str, default="127.0.0.1", help="bind address (0.0.0.0 to accept remote clients)")
        p.flag("--max_body_mb", type=float, default=32.0, help="largest request body (larger: 413)")
        p.flag("--max_queries", type=int, default=65536,
               help="most queries in a request, and most items of any list in it (more: 422)")
        p.flag("--max_query_chars", type=int, default=0,
               help="most characters in one query (more: 422, before tokenization); 0: --max_len x the longest "
                    "vocabulary entry, which no query within --max_len tokens exceeds")
        p.flag("--max_json_depth", type=int, default=32, help="deepest JSON nesting of a request (deeper: 422)")
        p.flag("--read_timeout_s", type=float, default=10.0,
               help="longest time to receive a request's headers, and then its body (slower: 408 / closed)")
        p.flag("--shutdown_timeout_s", type=float, default=5.0,
               help="on SIGTERM, longest wait for requests in progress before they are cancelled")
    with p.group("model loading and device"):
        add_dtype_flags(p, "compute dtype on GPU; CPU computes in fp32")
        add_attn_flags(p)
        add_load_in_4bit_flag(p, "load the weights in 4-bit NF4 (needs bitsandbytes and CUDA)")
        add_fast_tokenizer_flag(p)
        add_packing_flag(p, "OpenRLHF: pack queries into one row", inert="serve_rm pads its batches")
        add_experts_flag(p)
        add_use_ms_flag(p, "--reward_pretrain")
        add_device_flag(p)
        p.flag("--num_threads", type=int, default=0,
               help="torch CPU threads for the model; 0: on CPU one per core but one (a core for the HTTP "
                    "side), on GPU torch's default")
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
    experts_implementation: str | None = None
    max_body_mb: float = 32.0
    max_queries: int = 65536
    max_query_chars: int = 0  # 0: from --max_len and the vocabulary (RewardScorer.longest_token_chars)
    max_json_depth: int = 32
    read_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0 or self.max_body_mb <= 0:
            raise ValueError("--batch_wait_ms must be >= 0 and --max_body_mb > 0")
        if self.max_query_chars < 0:
            raise ValueError(f"--max_query_chars must be >= 0 (0: automatic), got {self.max_query_chars}")
        self.limits(1)  # the other limits' checks

    def limits(self, longest_token_chars: int) -> RequestLimits:
        chars = self.max_query_chars or self.max_len * max(1, longest_token_chars)
        return RequestLimits(max_body_bytes=int(self.max_body_mb * 1024 * 1024), max_queries=self.max_queries,
                             max_query_chars=chars, max_json_depth=self.max_json_depth,
                             read_timeout_s=self.read_timeout_s)


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
                           load_in_4bit=cfg.load_in_4bit, lora_rank=0,
                           experts_implementation=cfg.experts_implementation)
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

    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (byte-level entries count bytes, an upper bound)."""
        vocab = list(self.tokenizer.get_vocab()) + list(getattr(self.tokenizer, "all_special_tokens", []))
        return max((len(t) for t in vocab), default=1)

    def score_texts(self, texts: list[str]) -> list[float | Rejected]:
        """Tokenise one micro-batch (no special tokens added: queries are decoded with them; but a query
        without the BOS the tokenizer adds gets it, as in training: the BOS rule of rlhfkit.data.templates)
        and score it; an empty or too long text is `Rejected` instead (the worker thread of FairBatcher)."""
        from rlhfkit.data.templates import bos_prefix

        ids = [bos_prefix(self.tokenizer, row) + list(row) if row else []
               for row in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        out: list[float | Rejected] = [0.0] * len(texts)
        rows, where = [], []
        for k, row in enumerate(ids):
            if not row:
                out[k] = Rejected("is empty (no tokens to score)")
            elif len(row) > self.cfg.max_len:
                out[k] = Rejected(f"has {len(row)} tokens, more than --max_len {self.cfg.max_len}")
            else:
                rows.append(row)
                where.append(k)
        if rows:
            for k, score in zip(where, self.score(rows)):
                out[k] = score
        return out

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


# ----------------------------------------------------------------------------- HTTP


def _fastapi() -> Any:
    from rlhfkit.optional import require

    require("uvicorn", "serve_rm")
    return require("fastapi", "serve_rm")


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:  # not glibc
        return None


def one_malloc_arena() -> None:
    """glibc: one malloc arena for all threads. Memory freed in a thread's own arena (parsing, the
    tokenizer) is not given back by `malloc_trim` when it is the arena's top, and after a large free
    glibc raises its trim threshold, so a rejected 30 MB request left ~30 MB per thread behind."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-8, 1)  # M_ARENA_MAX


def release_memory() -> None:
    """Free what reference cycles still hold, and give freed C-heap pages back to the OS (glibc keeps
    them otherwise)."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


async def _until_disconnect(receive: Any) -> None:
    """Return when the client goes away (ASGI: after the body, `receive` blocks until then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(scorer: RewardScorer, cfg: ServeConfig) -> Any:
    """The FastAPI app; the scheduler runs as a task for the app's lifetime."""
    fastapi = _fastapi()
    from contextlib import asynccontextmanager

    from fastapi.responses import JSONResponse

    batcher = FairBatcher(scorer.score_texts, cfg.batch_size, cfg.batch_wait_ms / 1000.0)
    limits = cfg.limits(scorer.longest_token_chars())
    parse_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve_rm-parse")

    @asynccontextmanager
    async def lifespan(app: Any):  # type: ignore[no-untyped-def]
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.shutdown()
        parse_pool.shutdown(wait=False, cancel_futures=True)

    app = fastapi.FastAPI(title="rlhfkit serve_rm", lifespan=lifespan)
    app.state.batcher, app.state.limits = batcher, limits

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": cfg.reward_pretrain, "max_len": cfg.max_len,
                "batch_size": cfg.batch_size, "normalize_reward": cfg.normalize_reward,
                "num_threads": torch.get_num_threads(), "forwards": batcher.forwards,
                "sequences": batcher.sequences, "cancelled": batcher.cancelled, "dropped": batcher.dropped,
                "pending_requests": len(batcher.pending), "limits": dataclasses.asdict(limits)}

    def error(e: RequestError) -> Any:
        # 408 / 413: the rest of the body may still be on its way; do not read it as a next request
        headers = {"Connection": "close"} if e.status in (408, 413) else None
        return JSONResponse({"error": str(e)}, status_code=e.status, headers=headers)

    async def answer(request: Any, sizes: list[int]) -> Any:
        loop = asyncio.get_running_loop()
        with batcher.announce():
            body = await read_body(request.receive, request.headers.get("content-length"), limits)
            sizes.append(len(body))
            parsed = await loop.run_in_executor(parse_pool, parse_or_error, body, limits)
            del body
        if isinstance(parsed, RequestError):
            raise parsed
        work = asyncio.ensure_future(batcher.submit(parsed.query))
        gone = asyncio.ensure_future(_until_disconnect(request.receive))
        del parsed
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() or work.cancelled():
                raise ClientGone()
            raw = work.result()
        finally:  # client gone, or this handler cancelled (shutdown): drop the request's work
            work.cancel()
            gone.cancel()
            del work, gone  # an error raised here keeps this frame in its traceback: work -> error
        rewards = scorer.normalise(raw)
        return JSONResponse({"rewards": rewards, "scores": rewards, "extra_logs": {"raw_reward": raw}})

    async def get_reward(request: Any) -> Any:  # a plain Starlette route: it reads the raw body itself
        sizes: list[int] = []
        try:
            return await answer(request, sizes)
        except RequestError as e:
            return error(e)
        except ClientGone:
            return JSONResponse({"error": "client disconnected"}, status_code=499)  # never delivered
        finally:
            if sizes and sizes[0] >= TRIM_AFTER_BYTES:  # the request's objects are gone by now
                release_memory()

    app.add_route("/get_reward", get_reward, methods=["POST"])

    @app.exception_handler(Exception)
    async def on_error(request: Any, exc: Exception) -> Any:
        logger.exception("unhandled error")
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    return app


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    if not args.reward_pretrain:
        raise SystemExit("serve_rm: error: --reward_pretrain is required (a reward model directory or hub id)")
    return from_args(ServeConfig, args)


def choose_num_threads(requested: int, device: str) -> int:
    """torch threads for the model: `requested` if > 0; else on CPU one per usable core but one (see the
    module docstring), on GPU torch's current setting."""
    if requested < 0:
        raise ValueError(f"--num_threads must be >= 0 (0: automatic), got {requested}")
    if requested:
        return requested
    if device.startswith("cuda"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from rlhfkit.cli.common import check_packages, cli_main, resolve_model_paths

    def prepare() -> None:  # one error line, before the model loads: a missing package, a model not to be had
        _fastapi()
        check_packages(args)
        resolve_model_paths(args)

    cli_main("serve_rm", prepare)
    cfg = config_from_args(args)
    if args.shutdown_timeout_s < 0:
        raise SystemExit(f"serve_rm: error: --shutdown_timeout_s must be >= 0, got {args.shutdown_timeout_s}")
    import uvicorn

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    one_malloc_arena()
    cfg.device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(choose_num_threads(args.num_threads, cfg.device))
    sock = bind_port(args.host, args.port)  # a busy port fails here, before the model loads
    t0 = time.time()
    scorer = RewardScorer(cfg)
    app = create_app(scorer, cfg)
    sock.listen(2048)
    print(f"serve_rm: {cfg.reward_pretrain} loaded in {time.time() - t0:.1f} s on {scorer.device} "
          f"({torch.get_num_threads()} torch threads); listening on http://{args.host}:{args.port}/get_reward",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            http=header_timeout_protocol(cfg.read_timeout_s),
                            timeout_graceful_shutdown=args.shutdown_timeout_s)
    uvicorn.Server(config).run(sockets=[sock])


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (not listening yet); a port in use or an address that is not
    this host's ends the server in one line, before anything says it listens."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SystemExit(f"serve_rm: error: --host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not another listener's port: a TIME_WAIT one
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise SystemExit(f"serve_rm: error: cannot listen on {host}:{port} (--host / --port): {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
