"""Warm interpreters for the processes the tests start: torch, transformers and rlhfkit imported once.

Most of the suite's time on a small machine is interpreters starting: every `python -m rlhfkit.cli.*`
the tests, the docs pages and the OpenRLHF scripts run, every torchrun rank and every Ray actor
imports torch and transformers (seconds of CPU each) to train a tiny model for a step. Here a server
per import environment imports them once and forks a child for each such command; the child is set up
as the fresh interpreter would be (arguments, environment, working folder, descriptors, signals,
limits, stdio) and ends the same way, so a command's behaviour, output and exit status are what the
real interpreter gives. What cannot be reproduced that way runs on the real interpreter (warm_keys.py).

    tests' subprocess ─ PATH ─▶ <dir>/bin/python (client.py) ─ unix socket ─▶ server.py ─ fork ─▶ child
                                         └─ anything else: exec the real interpreter ─────────────────▶

`configure()` (called by tests/conftest.py in every pytest process) puts <dir>/bin first on PATH,
with `python`, `python3` and the venv's console scripts (rlhfkit, torchrun, ray ...) as clients and
every other entry of the venv's bin/ linked as it is, and points `sys.executable` at the client, so
torchrun ranks and the workers of a Ray started from the tests go through it too. The servers end
with the pytest run. `RLHFKIT_TEST_WARMSTART=0` turns all of it off (every process is a real one).
`RLHFKIT_WARM_TRACE=1` keeps the servers' logs (<dir>-logs), which then name every child's command
and the CPU time it used, and lists the commands run cold (fallbacks.log): a profile of the suite.

Known differences from a fresh interpreter, none of which a test reads: the child's parent is the
server, not the client (signals reach it through the client); it shares the server's str hash seed;
modules imported ahead ran their import-time code once in the server.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_NAMES = ("python", "python3", f"python3.{sys.version_info.minor}")
ENV_OFF = "RLHFKIT_TEST_WARMSTART"


def tool(name: str):
    """A module of this folder (client, warm_keys) imported by its own name, as they import each other."""
    sys.path.insert(0, HERE)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(HERE)


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1") != "0" and sys.platform.startswith("linux")


def run_dir(owner: int) -> str:
    return f"/tmp/rk-warm-{owner}"  # short: a unix socket's path has at most 107 bytes


def install(directory: str, real: str) -> str:
    """<directory>/bin: clients for the interpreters and console scripts of `real`'s bin/, links for the rest."""
    bin_dir = os.path.join(directory, "bin")
    if os.path.isdir(bin_dir):
        return bin_dir
    tmp = bin_dir + f".{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    venv_bin = os.path.dirname(real)
    exe = os.path.join(bin_dir, "python")
    for name in sorted(set(os.listdir(venv_bin)) | set(PYTHON_NAMES)):
        src = os.path.join(venv_bin, name)
        dst = os.path.join(tmp, name)
        if name in PYTHON_NAMES:
            _write_client(dst, real, exe, script=None)
        elif _is_console_script(src):
            _write_client(dst, real, exe, script=src)
        else:
            os.symlink(src, dst)
    try:
        os.rename(tmp, bin_dir)
    except OSError:  # another process of this run installed it first
        shutil.rmtree(tmp, ignore_errors=True)
    return bin_dir


def _write_client(path: str, real: str, exe: str, script: str | None) -> None:
    head = f"[{script!r}] + " if script else ""
    with open(path, "w") as f:
        f.write(f"#!{real} -SE\nimport sys\nsys.path.insert(0, {HERE!r})\nimport client\n"
                f"client.main({real!r}, {exe!r}, {head}sys.argv[1:])\n")
    os.chmod(path, 0o755)


def _is_console_script(path: str) -> bool:
    return os.path.isfile(path) and not os.path.islink(path) and tool("warm_keys")._is_console_script(path)


def configure(is_controller: bool, owner: int, prewarm_envs: list[dict[str, str]] = ()) -> str | None:
    """Route this pytest process's children through warm interpreters; the run's folder (None when off).
    The controller (the one process of a run that is not an xdist worker) starts the first servers,
    one for each of `prewarm_envs`, while the workers start up."""
    if not enabled():
        return None
    # the venv's python as started (a link: resolving it would leave the venv), never a client of an outer run
    real = os.environ["RLHFKIT_WARM_REAL"] if _is_client(sys.executable) else sys.executable
    directory = run_dir(owner)
    os.makedirs(directory, exist_ok=True)
    bin_dir = install(directory, real)
    path = os.environ.get("PATH", "")
    if not path.startswith(bin_dir + os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    os.environ.update(RLHFKIT_WARM_DIR=directory, RLHFKIT_WARM_OWNER=str(owner), RLHFKIT_WARM_REAL=real)
    sys.executable = os.path.join(bin_dir, "python")
    if is_controller and prewarm_envs:
        client, warm_keys = tool("client"), tool("warm_keys")
        ours = {k: os.environ[k] for k in ("PATH", "RLHFKIT_WARM_DIR", "RLHFKIT_WARM_OWNER", "RLHFKIT_WARM_REAL")}
        for env in prewarm_envs:
            env = {**env, **ours}
            client._start_server(directory, warm_keys.env_key(env, real), real, env, now=True)
    return directory


def wait_ready(env: dict[str, str] | None = None, timeout_s: float = 60.0) -> bool:
    """Wait until the server for `env`'s import environment (this process's by default) serves, or it is
    known that none will; whether one serves. For a long-lived process whose children should be warm (a
    Ray head, the raylet of an in-process Ray): one started before its server is up runs them all cold."""
    directory = os.environ.get("RLHFKIT_WARM_DIR")
    if not enabled() or not directory:
        return False
    env = dict(os.environ) if env is None else env
    key = tool("warm_keys").env_key(env, os.environ.get("RLHFKIT_WARM_REAL", sys.executable))
    sock, log = (os.path.join(directory, key + ext) for ext in (".sock", ".log"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(sock):
            return True
        if not os.path.exists(os.path.join(directory, key + ".lock")):
            return False  # nobody starts one
        if os.path.exists(log) and "not serving" in open(log).read():
            return False
        time.sleep(0.1)
    return False


def unconfigure(directory: str | None) -> None:
    """End the run's servers (each exits within a second once its folder is gone) and remove the folder."""
    if directory:
        if os.environ.get("RLHFKIT_WARM_TRACE"):  # keep the servers' logs
            logs = directory + "-logs"
            os.makedirs(logs, exist_ok=True)
            for name in os.listdir(directory):
                if name.endswith(".log"):  # the servers' and fallbacks.log
                    shutil.copy(os.path.join(directory, name), logs)
        shutil.rmtree(directory, ignore_errors=True)


def _is_client(path: str) -> bool:
    return path.startswith("/tmp/rk-warm-") and "RLHFKIT_WARM_REAL" in os.environ
