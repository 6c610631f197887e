"""tests/warmstart: a command run on a warm interpreter behaves as on a fresh one.

Each case runs the same probe program twice through the same client (bin/python of a private run
folder whose server imports only `json`): once warm, once with RLHFKIT_TEST_WARMSTART=0 (the real
interpreter), and compares what the program saw and how it ended: arguments, sys.path[0], working
folder, environment, open descriptors, umask, limits, signal dispositions, stdio, exit status, stderr
(tracebacks included), exit handlers and threads, files left open. Then: signals reach the child, a
killed client takes its child with it, and what cannot run warm runs on the real interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import warmstart

PROBE = textwrap.dedent('''
    import atexit, json, os, random, resource, signal, sys, threading, time
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    seen = {
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "var": os.environ.get("PROBE_VAR"),
        "fds": sorted(int(x) for x in os.listdir("/proc/self/fd"))[:-1], "umask": os.umask(0o022),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE), "name": __name__, "file": __file__,
        "spec": None if __spec__ is None else [__spec__.name, __spec__.origin],
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM,
                                                             signal.SIGCHLD, signal.SIGHUP)},
        "stdio": [(f.name, f.mode, f.encoding, f.errors, f.line_buffering, f.write_through,
                   type(f.buffer).__name__) for f in (sys.stdin, sys.stdout, sys.stderr)],
        "stdin": sys.stdin.read() if mode == "stdin" else None, "main_is_module": sys.modules["__main__"].__dict__ is globals(),
    }
    print(json.dumps(seen), flush=True)
    print(random.random(), flush=True)
    if mode == "exit3":
        sys.exit(3)
    if mode == "message":
        sys.exit("a message for stderr")
    if mode == "raise":
        def inner():
            raise ValueError("boom")
        inner()
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "finish":
        atexit.register(lambda: print("exit handler ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
        f = open(sys.argv[2], "w")
        f.write("written, never closed")  # flushed when the interpreter ends
        print("no newline at the end", end="")
    if mode == "sleep":
        print(os.getpid(), flush=True)
        time.sleep(60)
''')


@pytest.fixture(scope="module")
def warm():
    """(env of a warm run, env of a real run, bin/python) over a private run folder and its server."""
    d = tempfile.mkdtemp(prefix="rk-warm-t", dir="/tmp")
    real = os.environ.get("RLHFKIT_WARM_REAL", sys.executable)
    bin_dir = warmstart.install(d, real)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), RLHFKIT_WARM_DIR=d,
               RLHFKIT_WARM_OWNER=str(os.getpid()), RLHFKIT_WARM_PRELOAD="json", PROBE_VAR="x y")
    env.pop("RLHFKIT_TEST_WARMSTART", None)
    client, warm_keys = warmstart.tool("client"), warmstart.tool("warm_keys")
    client._start_server(d, warm_keys.env_key(env, real), real, env, now=True)
    sock = os.path.join(d, warm_keys.env_key(env, real) + ".sock")
    deadline = time.monotonic() + 60
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(sock), open(sock.replace(".sock", ".log")).read()
    yield env, dict(env, RLHFKIT_TEST_WARMSTART="0"), os.path.join(bin_dir, "python")
    shutil.rmtree(d, ignore_errors=True)


def run(python: str, env: dict, *args: str, cwd: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], cwd=cwd, env=env, input=stdin, capture_output=True, text=True,
                          timeout=60)


def both(warm, *args: str, cwd: str, stdin: str = "") -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    env_warm, env_real, python = warm
    return run(python, env_warm, *args, cwd=cwd, stdin=stdin), run(python, env_real, *args, cwd=cwd, stdin=stdin)


def seen(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.splitlines()[0])


@pytest.fixture
def probe(tmp_path) -> str:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "work").mkdir()
    return str(tmp_path / "probe.py")


@pytest.mark.parametrize("mode", ["plain", "stdin", "exit3", "message", "raise", "interrupt"])
def test_a_script_sees_and_ends_as_on_a_fresh_interpreter(warm, probe, mode):
    cwd = os.path.join(os.path.dirname(probe), "work")
    w, r = both(warm, probe, mode, "an arg", cwd=cwd, stdin="line one\nline two\n")
    assert seen(w) == seen(r)
    assert (w.returncode, w.stderr) == (r.returncode, r.stderr)
    expected = {"plain": 0, "stdin": 0, "exit3": 3, "message": 1, "raise": 1, "interrupt": -signal.SIGINT}[mode]
    assert w.returncode == expected, w.stderr
    if mode == "raise":  # the traceback is the program's own, none of the server's frames
        assert w.stderr.startswith("Traceback") and "warmstart" not in w.stderr and "boom" in w.stderr


def test_a_module_run_with_dash_m_sees_what_a_fresh_one_sees(warm, probe):
    cwd = os.path.dirname(probe)
    w, r = both(warm, "-m", "probe", "plain", cwd=cwd)
    assert seen(w) == seen(r) and seen(w)["spec"][0] == "probe" and seen(w)["path0"] == cwd
    assert (w.returncode, w.stderr) == (r.returncode, r.stderr) == (0, "")
    w, r = both(warm, "-u", "-m", "probe", "plain", cwd=cwd)
    assert seen(w) == seen(r) and seen(w)["stdio"][1][5] is True  # -u: write-through stdout


def test_exit_handlers_threads_and_open_files_finish_as_at_a_normal_exit(warm, probe, tmp_path):
    outs = []
    for env_i in (0, 1):
        target = tmp_path / f"left_open_{env_i}.txt"
        env = warm[env_i]
        p = run(warm[2], env, probe, "finish", str(target), cwd=str(tmp_path))
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout.splitlines()[2:])
        assert target.read_text() == "written, never closed"
    assert outs[0] == outs[1] == ["no newline at the endthread finished", "exit handler ran"]


def test_each_warm_run_draws_its_own_random_numbers(warm, probe, tmp_path):
    draws = {run(warm[2], warm[0], probe, cwd=str(tmp_path)).stdout.splitlines()[1] for _ in range(3)}
    assert len(draws) == 3


def _default_signals() -> None:
    """In the client before it starts: SIGINT and SIGTERM neither ignored nor blocked, whatever earlier
    tests or libraries left in this process (an ignored or blocked signal would not end a real
    interpreter either; what is inherited is compared in the test above)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _signal_state(pid: int) -> str:
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
    except OSError:
        return f"{pid}: gone"
    return f"{pid}: " + " ".join(x.replace("\t", "") for x in lines if x.startswith(("State", "SigBlk", "SigIgn", "SigCgt")))


def test_signals_reach_the_child_and_a_killed_client_takes_it_along(warm, probe, tmp_path):
    env_warm, _, python = warm
    for sig in (signal.SIGTERM, signal.SIGINT):
        p = subprocess.Popen([python, probe, "sleep"], env=env_warm, stdout=subprocess.PIPE, text=True,
                             preexec_fn=_default_signals)
        pid = int([p.stdout.readline() for _ in range(3)][-1])
        assert pid != p.pid  # the child of the server
        p.send_signal(sig)
        try:
            code = p.wait(30)  # SIGINT: an unhandled KeyboardInterrupt, which ends CPython by SIGINT
        except subprocess.TimeoutExpired:
            states = [_signal_state(x) for x in (os.getpid(), p.pid, pid)]
            p.kill()
            pytest.fail(f"{sig.name} did not end the client; this process, client, child: {states}")
        assert code == -sig
    p = subprocess.Popen([python, probe, "sleep"], env=env_warm, stdout=subprocess.PIPE, text=True)
    pid = int([p.stdout.readline() for _ in range(3)][-1])
    p.kill()
    p.wait(30)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_child_killed_outright_ends_its_client_alike(warm, probe):
    """A warm child ended by SIGKILL (as Ray ends its workers) ends its client by SIGKILL too: no traceback
    from resetting a handler SIGKILL cannot have, no exit status 1 in its place."""
    env_warm, _, python = warm
    p = subprocess.Popen([python, probe, "sleep"], env=env_warm, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    pid = int([p.stdout.readline() for _ in range(3)][-1])
    assert pid != p.pid
    os.kill(pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    assert "Traceback" not in p.stderr.read()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_what_cannot_run_warm_runs_on_the_real_interpreter(warm, probe, tmp_path):
    env_warm, _, python = warm
    where = [sys.executable.split(os.sep)[-1], "-c", "import sys; print(sys.executable)"]
    real = os.environ.get("RLHFKIT_WARM_REAL", sys.executable)
    assert run(python, env_warm, *where[1:], cwd=str(tmp_path)).stdout.strip() == real  # -c
    script = tmp_path / "where.py"
    script.write_text("import sys\nprint(sys.executable)\n")
    assert run(python, env_warm, str(script), cwd=str(tmp_path)).stdout.strip() == python  # warm
    other = dict(env_warm, HF_HOME=str(tmp_path / "hf"))  # read while importing: another server's environment
    assert run(python, other, str(script), cwd=str(tmp_path)).stdout.strip() == real
    (tmp_path / "json.py").write_text("print('the local json')\n")  # shadows a module the server imported
    assert run(python, env_warm, str(script), cwd=str(tmp_path)).stdout.strip() == real


def test_the_trace_reports_each_childs_cpu_time(warm, tmp_path):
    """With RLHFKIT_WARM_TRACE set, the server's log names each child's command and the CPU it used
    (the suite's profile): 0.3 s of work counts, 0.4 s asleep does not."""
    (tmp_path / "burn.py").write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n"
                                      "    pass\ntime.sleep(0.4)\n")
    env, _, python = warm
    p = run(python, dict(env, RLHFKIT_WARM_TRACE="1"), str(tmp_path / "burn.py"), "burn-marker", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    key = warmstart.tool("warm_keys").env_key(env, os.environ.get("RLHFKIT_WARM_REAL", sys.executable))
    log = open(os.path.join(env["RLHFKIT_WARM_DIR"], key + ".log")).read()
    ended = [line for line in log.splitlines() if " ended (0) after " in line and "burn-marker" in line]
    assert len(ended) == 1, log[-2000:]
    cpu = float(ended[0].split(" after ")[1].split(" s of CPU")[0])
    assert 0.28 <= cpu < 0.65, ended[0]


def test_rays_daemons_run_on_the_real_interpreter():
    """Ray's daemons (they watch their parent) and its client server (one a head, in an environment of its
    own) are not run warm; a Ray worker and an rlhfkit command are."""
    keys = warmstart.tool("warm_keys")
    site = os.path.dirname(os.path.dirname(os.path.abspath(keys.__file__)))  # any folder: only the path's tail counts
    ray = os.path.join(site, "ray", "_private")
    assert keys.parse_command([os.path.join(ray, "log_monitor.py"), "--session-dir=x"]) is None
    assert keys.parse_command([os.path.join(ray, "workers", "setup_worker.py"), "-m", "ray.util.client.server",
                               "--port=10001"]) is None
    worker = os.path.join(ray, "workers", "default_worker.py")
    assert keys.parse_command([worker, "--node-ip-address=127.0.0.1"]) == ([], "script", worker,
                                                                           ["--node-ip-address=127.0.0.1"])
    assert keys.parse_command(["-u", "-m", "rlhfkit.cli.train_sft", "--x"]) == (["-u"], "module",
                                                                                "rlhfkit.cli.train_sft", ["--x"])
