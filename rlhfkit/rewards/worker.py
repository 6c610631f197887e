"""One reward worker process of `process_pool.ProcessRewardSource` (``--reward_workers``).

    python /path/to/rlhfkit/rewards/worker.py ANSWER_FD /path/to/reward_func.py [FUNCTION]

Run as a script (a fresh interpreter), not as ``-m rlhfkit.rewards.worker``, so that starting a
worker imports nothing but the user's file (and what it imports itself). It imports the file once,
then serves calls until its stdin closes: each request is a frame on stdin (8-byte big-endian length,
then a pickle of ``(args, kwargs)``: the trainer built them for the function's shape, OpenRLHF's
``(queries, prompts, labels)`` or TRL's keywords); each answer a frame on the inherited pipe
``ANSWER_FD``: ``("ok", value, "")`` or ``("error", text, frames)``, where ``frames`` are the traceback
lines of the user's own code (the trainer prints them under its error line, as for a call in a thread).
An exception in ``reward_func`` (``SystemExit`` included) is an ``"error"`` answer and the worker goes
on; an ``async def`` reward_func is run to completion with ``asyncio.run``. What the user's code prints
goes to the trainer's stdout and stderr, as in a thread: the answers have a pipe of their own.

The worker dies with the trainer (Linux: ``PR_SET_PDEATHSIG``), so a call that never returns is not
left running when the trainer is killed; the trainer kills it itself past ``--reward_timeout``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import pickle
import signal
import struct
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)
LIBRARY_DIRS = tuple({os.path.dirname(os.__file__), sys.prefix, sys.base_prefix, sys.exec_prefix})


def read_frame(stream) -> bytes | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack(">Q", head)
    body = stream.read(n)
    return body if len(body) == n else None


def write_frame(stream, payload: bytes) -> None:
    stream.write(struct.pack(">Q", len(payload)) + payload)
    stream.flush()


def die_with_parent() -> None:
    """SIGKILL this process when the trainer dies (a GIL-holding call could not notice it)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker ends when its stdin closes
        return
    if os.getppid() != parent:  # the trainer died before prctl
        os._exit(1)


def _is_user_frame(filename: str) -> bool:
    """Not this worker's, rlhfkit's (its shipped examples excepted), the standard library's or a package's."""
    path = os.path.abspath(filename)
    if filename.startswith("<") or "site-packages" in path:
        return False
    if path.startswith(os.path.join(PACKAGE, "examples") + os.sep):
        return True
    return not path.startswith(PACKAGE + os.sep) and not any(path.startswith(d + os.sep) for d in LIBRARY_DIRS)


def user_frames(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_frame(f.filename)]
    lines = [line.rstrip() for chunk in traceback.format_list(frames) for line in chunk.splitlines()]
    return "\n".join(line for line in lines if line.strip(" ^~"))


def _load(path: str, name: str = "reward_func"):
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # sibling helper modules of the user file, as in the trainer
    spec = importlib.util.spec_from_file_location("rlhfkit_reward_worker_user", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def _call(fn, request):
    args, kwargs = request
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        async def wait():
            return await result
        result = asyncio.run(wait())
    return result


def _answer(fn, request: bytes) -> bytes:
    try:
        answer = ("ok", _call(fn, pickle.loads(request)), "")
    except BaseException as e:  # noqa: BLE001 - SystemExit of user code fails the call, not the worker
        answer = ("error", f"reward_func raised {type(e).__name__}: {e}", user_frames(e))
    try:
        return pickle.dumps(answer)
    except Exception as e:  # noqa: BLE001
        return pickle.dumps(("error", f"reward_func returned a value that cannot be sent back "
                                      f"({type(e).__name__}: {e})", ""))


def main() -> None:
    answer_fd, path = int(sys.argv[1]), sys.argv[2]
    name = sys.argv[3] if len(sys.argv) > 3 else "reward_func"
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it ends the workers
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # no shadowing by this folder
    sys.path.insert(0, os.path.dirname(PACKAGE))  # the user file may import rlhfkit
    answers = os.fdopen(answer_fd, "wb")
    requests = os.fdopen(0, "rb")
    try:
        fn = _load(path, name)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which names the file
        _send(answers, pickle.dumps(("error", f"importing the file failed: {type(e).__name__}: {e}",
                                     user_frames(e))))
        return
    _send(answers, pickle.dumps(("ok", None, "")))
    while True:
        request = read_frame(requests)
        if request is None:
            return
        _send(answers, _answer(fn, request))


def _send(answers, payload: bytes) -> None:
    """One answer to the trainer; if it no longer reads (its run ended while this worker loaded the file or ran
    a call), the worker leaves quietly, not with a traceback on the terminal the trainer shares."""
    try:
        write_frame(answers, payload)
    except OSError:
        os._exit(1)


if __name__ == "__main__":
    main()
