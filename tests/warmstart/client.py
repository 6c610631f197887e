"""The `python` the tests' processes start: hands its command to a warm interpreter, or runs the real one.

bin/python, bin/python3 and the console scripts of bin/ (see `warmstart.install`) run this file
with `python -SE` (no site, no PYTHON* variables: a few milliseconds). It

1. decides from the command line and the import-time environment whether a warm interpreter can run
   the command as the real one would (warm_keys.py); if not, or none is up for that environment, it
   `exec`s the real interpreter with the same arguments (starting a warm one for next time);
2. otherwise sends the server its arguments, environment, working folder, umask, limits, signal state
   and every descriptor it inherited, gets the child's pid, forwards each signal it receives to the
   child, and ends as the child ended: the same exit status, or killed by the same signal.

If this process is killed (SIGKILL), the server sees its connection close and kills the child's
process group.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGWINCH)
MAX_WARM = 12  # warm interpreters a run may start (each holds torch + transformers, ~0.5 GB)


def main(real: str, executable: str, args: list[str]) -> None:
    """Run `real args` (the command `executable args` as a test wrote it) warm if possible."""
    directory = os.environ.get("RLHFKIT_WARM_DIR", "")
    if not directory or not os.path.isdir(directory) or os.environ.get("RLHFKIT_TEST_WARMSTART") == "0":
        _exec(real, args)
    sys.path.insert(0, HERE)
    import warm_keys

    if warm_keys.parse_command(args) is None:
        _fallback(directory, real, args, "command line")
    env = dict(os.environ)
    key = warm_keys.env_key(env, real)
    inherited = _inherited_fds()  # before this process opens anything of its own
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.path.join(directory, key + ".sock"))
    except OSError:
        sock.close()
        _start_server(directory, key, real, env)
        _fallback(directory, real, args, f"no server for {key}")
    from warm_wire import recv_msg, send_msg

    req = {"args": args, "env": env, "cwd": os.getcwd(), "umask": _umask(), "executable": executable,
           "rlimits": {name: list(resource.getrlimit(getattr(resource, name)))
                       for name in dir(resource) if name.startswith("RLIMIT_")},
           "ignored": [int(s) for s in FORWARDED + (signal.SIGPIPE,) if signal.getsignal(s) == signal.SIG_IGN],
           "blocked": [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
           "fds": inherited}
    child = Forwarder()
    try:
        send_msg(sock, req, inherited)
    except OSError as e:  # the server has no whole request: it runs nothing
        sock.close()
        child.restore()
        _fallback(directory, real, args, f"{key}: request not sent ({type(e).__name__}: {e})")
    try:
        answer, _ = recv_msg(sock)
    except OSError as e:
        answer = None
    if answer is not None and "refused" in answer:  # nothing ran
        sock.close()
        child.restore()
        _fallback(directory, real, args, f"{key} refused: {answer['refused']}")
    if answer is None:  # it may have started the command: running it again here could run it twice
        print(f"warmstart: the warm interpreter {key} did not answer; the command may not have run", file=sys.stderr)
        os._exit(1)
    child.started(answer["pid"])
    while True:
        try:
            msg, _ = recv_msg(sock)
        except OSError:
            msg = None
        if msg is None:
            print(f"warmstart: the warm interpreter ended before child {answer['pid']} reported its exit",
                  file=sys.stderr)
            os._exit(1)
        if "status" in msg:
            _end_as(msg["status"])


class Forwarder:
    """Every signal this process gets goes to the child, even one inherited as ignored (the child starts
    ignoring it too, but may install a handler); those that come before the child exists wait for it."""

    def __init__(self) -> None:
        self.pid = 0
        self.pending: list[int] = []
        self.old = {sig: signal.signal(sig, self.forward) for sig in FORWARDED}

    def forward(self, sig: int, _frame=None) -> None:
        if not self.pid:
            self.pending.append(sig)
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def started(self, pid: int) -> None:
        self.pid = pid
        for sig in self.pending:
            self.forward(sig)

    def restore(self) -> None:
        """The dispositions this process came with, and the signals that came meanwhile delivered to it:
        they reach the real interpreter as they would have (early in its start-up)."""
        for sig, old in self.old.items():
            signal.signal(sig, old)
        for sig in self.pending:
            os.kill(os.getpid(), sig)


def _fallback(directory: str, real: str, args: list[str], reason: str) -> None:
    if os.environ.get("RLHFKIT_WARM_TRACE"):
        try:
            with open(os.path.join(directory, "fallbacks.log"), "a") as f:
                f.write(f"{reason}\t{' '.join(args)[:300]}\n")
        except OSError:
            pass
    _exec(real, args)


def _exec(real: str, args: list[str]) -> None:
    os.execv(real, [real, *args])


def _inherited_fds() -> list[int]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if os.get_inheritable(fd):
                out.append(fd)
        except OSError:
            pass
    return sorted(out)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def _end_as(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset: EINVAL)
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _start_server(directory: str, key: str, real: str, env: dict[str, str], now: bool = False) -> None:
    """Start the warm interpreter for this environment the second time it is asked for (a one-off
    environment is not worth its start-up), or `now`; once per key and at most MAX_WARM a run; detached
    (double fork: never this program's child once it execs)."""
    if not now:
        try:
            os.close(os.open(os.path.join(directory, key + ".seen"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return  # the first time
        except FileExistsError:
            pass
        except OSError:
            return
    lock = os.path.join(directory, key + ".lock")
    try:
        if len([n for n in os.listdir(directory) if n.endswith(".lock")]) >= MAX_WARM:
            return
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return  # another process starts it, or it is up already
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        log = os.open(os.path.join(directory, key + ".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 65536)
        os.chdir(directory)
        os.execve(real, [real, os.path.join(HERE, "server.py"), directory, key], env)
    finally:
        os._exit(1)
