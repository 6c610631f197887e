"""rlhfkit/parallel/rendezvous.py: race-free master ports, the gloo exit settle, and run_main's exit.

    reserve_port      the kernel-picked port is served at once (a second bind of it fails with
                      EADDRINUSE, a client store reaches it); held_store hands it over once
    init_distributed  rank 0 forms its group on the held store and rank 1 joins through env://
                      (a 2-process all_reduce of 1 and 2 gives 3 on both)
    run_main          in a process that joined a group: exit status 0 / 3 / 1 for a normal end,
                      sys.exit(3), SystemExit("error: ...") and an exception, as the interpreter
                      gives them, with the message or traceback printed, exit handlers run and
                      unterminated output flushed; outside a group it returns / raises unchanged
    wait_threads_idle True with no matching threads; False while a thread of that name computes
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as tdist
from helpers import subprocess_env

from rlhfkit.parallel import rendezvous


def test_reserved_port_is_served_and_handed_over_once():
    port = rendezvous.reserve_port(timeout_s=30)
    with socket.socket() as s, pytest.raises(OSError) as err:
        s.bind(("127.0.0.1", port))
    assert err.value.errno == errno.EADDRINUSE
    import datetime

    client = tdist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
    client.set("k", "v")
    store = rendezvous.held_store(port, timeout_s=10)
    assert store is not None and store.get("k") == b"v"
    assert rendezvous.held_store(port) is None


def _run(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], env=subprocess_env(**env), capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.skipif(not tdist.is_gloo_available(), reason="gloo is not available")
def test_rank0_forms_its_group_on_the_held_store(tmp_path):
    code = """
        import os, subprocess, sys
        import torch
        from rlhfkit.parallel import rendezvous
        from rlhfkit.parallel.dist import init_distributed

        if len(sys.argv) == 1:  # rank 0: reserve, start rank 1 on the port, join
            port = rendezvous.reserve_port(60)
            env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            peer = subprocess.Popen([sys.executable, __file__, "peer"], env=env)
            os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        info = init_distributed("cpu")
        t = torch.tensor([float(info.rank + 1)])
        torch.distributed.all_reduce(t)
        print(f"rank {info.rank} sum {t.item()} held {rendezvous.held_port_count()}", flush=True)
        if info.rank == 0:
            assert peer.wait(60) == 0
    """
    res = _run(code, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 0 sum 3.0 held 0" in res.stdout and "rank 1 sum 3.0" in res.stdout


GROUP = """
    import atexit, os, sys, datetime
    import torch.distributed as dist
    from rlhfkit.parallel.rendezvous import destroy_at_exit, run_main

    def main():
        if {join}:
            store = dist.HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            destroy_at_exit()
        atexit.register(lambda: open(sys.argv[1], "w").write("ran"))
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(2)  # non-daemon workers, shut down by the interpreter's own exit path
        assert pool.submit(lambda: 1).result() == 1
        sys.stdout.write("partial line")  # no newline: must still reach the pipe
        global LOG
        LOG = open(sys.argv[1] + ".log", "w")  # left open, buffered: its text must reach the disk
        LOG.write("kept")
        {end}

    run_main(main)
    print("returned")
"""


def _run_group_script(tmp_path, join: bool, end: str):
    marker = tmp_path / "atexit.txt"
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(GROUP.format(join=join, end=end)))
    res = subprocess.run([sys.executable, str(script), str(marker)], env=subprocess_env(), capture_output=True,
                         text=True, timeout=120, check=False)
    return res, marker


@pytest.mark.skipif(not tdist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("end, code, err", [
    ("pass", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("raise SystemExit('error: --flag is bad')", 1, "error: --flag is bad"),
    ("raise ValueError('row 7 is bad')", 1, "ValueError: row 7 is bad"),
])
def test_run_main_exit_status_in_a_group(tmp_path, end, code, err):
    res, marker = _run_group_script(tmp_path, True, end)
    assert res.returncode == code, res.stderr
    assert err in res.stderr
    if end == "raise ValueError('row 7 is bad')":
        assert "Traceback" in res.stderr
    assert res.stdout == "partial line"  # os._exit: nothing after run_main ran
    assert marker.read_text() == "ran"
    assert (tmp_path / "atexit.txt.log").read_text() == "kept"


@pytest.mark.parametrize("end, code", [("pass", 0), ("sys.exit(3)", 3)])
def test_run_main_outside_a_group_is_plain(tmp_path, end, code):
    res, marker = _run_group_script(tmp_path, False, end)
    assert res.returncode == code, res.stderr
    assert res.stdout == ("partial linereturned\n" if code == 0 else "partial line")
    assert marker.read_text() == "ran"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_wait_threads_idle_sees_a_busy_native_thread():
    assert rendezvous.wait_threads_idle(("rlhfkit_none",), timeout_s=0.5)
    stop, named = threading.Event(), threading.Event()
    libc = ctypes.CDLL(None)

    def busy():
        libc.prctl(15, b"rlhfkit_busy", 0, 0, 0)  # PR_SET_NAME
        named.set()
        blob = bytes(16 << 20)
        while not stop.is_set():  # hashing runs on this thread with the GIL released (a matmul may run on
            hashlib.sha256(blob)  # torch's worker threads while this one sleeps)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    assert named.wait(30)  # before it has its name, no thread of that name exists (and none is busy)
    try:
        assert not rendezvous.wait_threads_idle(("rlhfkit_busy",), timeout_s=0.3)
    finally:
        stop.set()
        t.join()
    assert rendezvous.wait_threads_idle(("rlhfkit_busy",), timeout_s=1.0)
