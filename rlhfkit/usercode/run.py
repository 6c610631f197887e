"""Running user code (reward_func files, agent environments) where a time limit can end it.

User code may block: a sync function that sleeps, or an ``async def`` that calls ``time.sleep``
and never awaits. On the trainer's event loop such code would stall every episode, and no
``asyncio`` time limit could fire (the loop that would fire it is the one blocked). So user code
never runs on the trainer's loop:

    trainer's loop (main thread)                    UserLoop: a daemon thread with its own loop
    run_user_code(fn, *args, timeout_s) --submit-->  fn(*args), awaited there if it is a coroutine
      waits at most timeout_s          <--result---
      past it: EpisodeError; the call is cancelled and the thread is left to end by itself

A ``UserLoop`` serves one ``reward_func`` call, or one agent episode (instance creation,
``reset``, every ``step``), so objects an agent instance keeps between calls (an aiohttp session)
stay on one loop, and a sample that blocks cannot hold up another sample's calls. (The price: a
``reward_func`` must not cache loop-bound objects across calls; create them inside the call.)

Exceptions of user code become ``EpisodeError`` naming ``what``. So do ``SystemExit`` and
``KeyboardInterrupt``: raised in a worker thread they can only come from the user's code (a real
Ctrl-C goes to the main thread), so ``sys.exit()`` in a reward_func fails that sample instead of
ending the trainer. A thread that never returns cannot be killed; ``shutdown_user_threads`` (called
when a trainer exits) stops the loops and waits briefly for the threads still running user code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from typing import Any, Callable


class EpisodeError(Exception):
    """User code (agent reset/step, reward function, reward server) failed for one sample."""


class _UserExit(Exception):
    """``SystemExit`` / ``KeyboardInterrupt`` raised by user code, carried out of its loop as an
    ordinary exception (asyncio re-raises those two out of the loop itself)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        super().__init__(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


async def _invoke(fn: Callable[..., Any], args: tuple) -> Any:
    try:
        result = fn(*args)
        if inspect.isawaitable(result):
            result = await result
        return result
    except (SystemExit, KeyboardInterrupt) as e:
        raise _UserExit(e) from None


_live: set["UserLoop"] = set()
_live_lock = threading.Lock()


class UserLoop:
    """A daemon thread running its own event loop, started at the first ``submit``."""

    def __init__(self, name: str = "rlhfkit-user-code") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], args: tuple = ()) -> concurrent.futures.Future:
        """Run ``fn(*args)`` (awaited if it returns an awaitable) on this loop."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the user-code loop is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                with _live_lock:
                    _live.add(self)
                self._thread.start()
            return asyncio.run_coroutine_threadsafe(_invoke(fn, args), self._loop)

    def _serve(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except BaseException:  # noqa: BLE001 - nothing may escape a worker thread at exit
            pass
        finally:
            loop.close()
            with _live_lock:
                _live.discard(self)

    def close(self) -> None:
        """Ask the loop to stop (never waits: its thread may be stuck in user code)."""
        with self._lock:
            self._closed = True
            loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # already closed
                pass

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread to end; True if it has."""
        if self._thread is not None:
            self._thread.join(max(timeout_s, 0.0))
            return not self._thread.is_alive()
        return True


def shutdown_user_threads(timeout_s: float = 5.0) -> int:
    """Stop every user-code loop and wait up to ``timeout_s`` in all for their threads; returns how
    many are still running user code (abandoned: they are daemon threads)."""
    with _live_lock:
        loops = list(_live)
    for ul in loops:
        ul.close()
    deadline = time.monotonic() + timeout_s
    return sum(not ul.join(deadline - time.monotonic()) for ul in loops)


async def run_user_code(fn: Callable[..., Any], *args: Any, what: str, timeout_s: float | None,
                        loop: UserLoop | None = None, limit_flag: str = "--reward_timeout") -> Any:
    """``fn(*args)`` (sync or async) on ``loop`` (a fresh one-call loop when None), at most
    ``timeout_s`` seconds; any failure of the user's code raises ``EpisodeError`` naming ``what``."""
    own = loop is None
    if own:
        loop = UserLoop(f"rlhfkit-user:{what}"[:60])
    try:
        fut = asyncio.wrap_future(loop.submit(fn, args))
        try:
            async with asyncio.timeout(timeout_s) as cm:
                return await fut
        except TimeoutError as e:
            if cm.expired():
                raise EpisodeError(f"{what} did not return within {timeout_s:g} s ({limit_flag})") from None
            raise EpisodeError(f"{what} raised TimeoutError: {e}") from e
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we are being cancelled (e.g. another sample stopped the run)
            raise EpisodeError(f"{what} raised asyncio.CancelledError") from None
        except _UserExit as e:
            raise EpisodeError(f"{what} raised {e} (user code may not end the trainer)") from None
        except EpisodeError:
            raise
        except Exception as e:
            raise EpisodeError(f"{what} raised {type(e).__name__}: {e}") from e
    finally:
        if own:
            loop.close()
