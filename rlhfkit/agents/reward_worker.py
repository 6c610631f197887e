"""One reward worker process of `reward_pool.ProcessRewardSource` (``--reward_workers N``).

    python /path/to/rlhfkit/agents/reward_worker.py /path/to/reward_func.py

Run as a script, not as ``-m rlhfkit.agents.reward_worker``, so that starting a worker imports
nothing but the user's file (and what it imports itself). It imports the file once, then serves
calls until its stdin closes: each request is a frame (8-byte big-endian length, then a pickle of
``(queries, prompts, labels)``); each answer a frame of ``("ok", value)`` or ``("error", text)``.
An exception in ``reward_func`` (``SystemExit`` included) is an ``"error"`` answer and the worker
goes on; an ``async def`` reward_func is run to completion with ``asyncio.run``. What the user's
code prints goes to stderr: stdout carries the frames.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import pickle
import struct
import sys


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


def _load(path: str):
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # sibling helper modules of the user file, as in the trainer
    spec = importlib.util.spec_from_file_location("rlhfkit_reward_worker_user", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.reward_func


def _call(fn, args):
    result = fn(*args)
    if inspect.isawaitable(result):
        async def wait():
            return await result
        result = asyncio.run(wait())
    return result


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # no shadowing by this folder
    sys.path.insert(0, os.path.dirname(os.path.dirname(here)))  # the user file may import rlhfkit
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints of user code go to stderr
    sys.stdout = sys.stderr
    frames_in = os.fdopen(0, "rb")
    try:
        fn = _load(sys.argv[1])
        write_frame(frames_out, pickle.dumps(("ok", None)))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which names the file
        write_frame(frames_out, pickle.dumps(("error", f"importing the file failed: {type(e).__name__}: {e}")))
        return
    while True:
        req = read_frame(frames_in)
        if req is None:
            return
        try:
            answer = ("ok", _call(fn, pickle.loads(req)))
        except BaseException as e:  # noqa: BLE001 - SystemExit of user code fails the call, not the worker
            answer = ("error", f"reward_func raised {type(e).__name__}: {e}")
        try:
            payload = pickle.dumps(answer)
        except Exception as e:  # noqa: BLE001
            payload = pickle.dumps(("error", f"reward_func returned a value that cannot be sent back "
                                             f"({type(e).__name__}: {e})"))
        write_frame(frames_out, payload)


if __name__ == "__main__":
    main()
