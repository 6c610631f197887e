"""The reward server's HTTP side: `create_app(scorer, cfg)` (FastAPI; requests read and parsed under limits,
their queries scored in fair micro-batches, a client that goes away loses its queries not yet scored),
the process's memory handling (one glibc malloc arena, the C heap trimmed after large bodies), the torch
thread count and the bound socket (`rlhfkit.cli.serve_rm`'s docstring has the whole picture)."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlhfkit.serving.batcher import FairBatcher
from rlhfkit.serving.request import ClientGone, RequestError, parse_or_error, read_body
from rlhfkit.serving.scorer import RewardScorer, ServeConfig

logger = logging.getLogger("rlhfkit.serve_rm")
TRIM_AFTER_BYTES = 1 << 20  # trim the C heap after bodies this large


def import_fastapi() -> Any:
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
    fastapi = import_fastapi()
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
