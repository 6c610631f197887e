"""Race-free rendezvous ports for the groups rlhfkit forms itself, and a clean exit for gloo ranks.

Ports. A group formed outside torchrun (a Ray role group, a tensor-parallel engine's shards, the
weight-sync broadcast group) needs a master port that its rank 0 serves and every member is told.
Picking a "free" port (bind port 0, close, hand the number on) races: between the close and the
store's own bind another group or process can take it, and the group fails with EADDRINUSE (seen
in CI with several Ray groups forming at once). Here rank 0's process instead opens the master
TCPStore itself on port 0 (`reserve_port`), so the kernel binds it in one step, and keeps it; the
members are told its port, and rank 0 forms its group on that very store (`held_store`).

Exit. At the end of a run, a gloo worker thread can still be releasing the last collective's work
(tensors with Python references) when the interpreter starts its teardown; a thread that asks for
the GIL then is ended by the interpreter and the C++ runtime aborts the process ("terminate called
without an active exception", exit -6, after the run's output was complete). `destroy_at_exit`
destroys the group at exit while the interpreter is whole and lets those threads settle
(`wait_threads_idle`); entry points run under `run_main`, which in a process that joined a group
ends it with `os._exit` once every exit handler ran and everything is flushed, so no native thread
can meet the teardown at all.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import io
import os
import sys
import threading
import time
from typing import Any, Callable

_HELD: dict[int, Any] = {}
_LOCK = threading.Lock()


def reserve_port(timeout_s: float = 3600.0) -> int:
    """Open a master TCPStore on a port the kernel picks and keep it for `held_store`; its port."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    port = int(store.port)
    with _LOCK:
        _HELD[port] = store
    return port


def held_store(port: int, timeout_s: float | None = None) -> Any | None:
    """The master store `reserve_port` opened on `port` in this process (handed over once), or None."""
    with _LOCK:
        store = _HELD.pop(int(port), None)
    if store is not None and timeout_s is not None:
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def held_port_count() -> int:
    with _LOCK:
        return len(_HELD)


_GLOO_THREADS = ("pt_gloo", "gloo_")


def _thread_states(prefixes: tuple[str, ...]) -> list[str] | None:
    """Scheduler states ('R', 'S', ...) of this process's native threads named with `prefixes`;
    None where /proc is not there."""
    base = "/proc/self/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            if not name.startswith(prefixes):
                continue
            with open(f"{base}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        states.append(stat[stat.rfind(")") + 2:].split(" ", 1)[0])
    return states


def wait_threads_idle(prefixes: tuple[str, ...] = _GLOO_THREADS, timeout_s: float = 2.0,
                      quiet_polls: int = 3, poll_s: float = 0.005) -> bool:
    """Sleep (the GIL released) until every native thread named with `prefixes` has been asleep for
    `quiet_polls` polls in a row, at most `timeout_s`; True when they settled (or there are none)."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while True:
        states = _thread_states(prefixes)
        if states is None:  # no /proc: give them one short pause
            time.sleep(0.05)
            return True
        quiet = quiet + 1 if all(s in ("S", "D", "I") for s in states) else 0
        if quiet >= quiet_polls:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


_EXIT_HOOKED = False


def _destroy_and_settle() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - nothing to report at exit
        pass
    wait_threads_idle()


def destroy_at_exit() -> None:
    """At interpreter exit, while it is still whole: destroy the default process group, then wait
    for gloo's threads to settle (see the module's docstring). Registered once per process."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        _EXIT_HOOKED = True
        atexit.register(_destroy_and_settle)


def _exit_code(exc: BaseException | None) -> int:
    """The status CPython exits with after `exc` ends the main module, printing what it would print."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        print(code, file=sys.stderr)
        return 1
    if isinstance(exc, KeyboardInterrupt):
        return 130
    sys.excepthook(type(exc), exc, exc.__traceback__)
    return 1


def run_main(main: Callable[[], Any]) -> None:
    """Run an entry point's `main()`. In a process that joined a process group, end it without the
    interpreter's teardown once everything is written: the exit handlers run (the group is destroyed,
    gloo's threads settle), open files are collected, stdout and stderr flushed, then `os._exit` with
    the status the interpreter would have used. A torch native thread still running in teardown can
    abort a finished run ("terminate called without an active exception", exit -6). Elsewhere this is
    `main()`, unchanged."""
    exc: BaseException | None = None
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - turned into the interpreter's own exit status below
        exc = e
    if not _joined_a_group():
        if exc is not None:
            raise exc
        return
    code = _exit_code(exc)
    del exc
    try:
        # as the interpreter does: executors are shut down and non-daemon threads joined, then the exit handlers
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None and threading.current_thread() is threading.main_thread():
            shutdown()
        atexit._run_exitfuncs()
        gc.collect()
    finally:
        _flush_open_files()
        os._exit(code)


def _flush_open_files() -> None:
    """Flush every open file object still alive (the interpreter's teardown would), stdout and stderr last."""
    gc.unfreeze()  # objects frozen by gc.freeze() are not listed otherwise
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase) and obj not in (sys.stdout, sys.stderr):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken or detached file has nothing left to write
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def _joined_a_group() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and (dist.is_initialized() or _EXIT_HOOKED))
    except Exception:  # noqa: BLE001
        return False
