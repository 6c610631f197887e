"""A warm interpreter: imports torch, transformers and rlhfkit once, then forks a child per command.

    client (bin/python: a few ms)                 server (this file, one per import environment)
      argv, env, cwd, umask, limits,    ─────▶      fork ─▶ child: new session, the client's fds at their
      signal state + its open fds (SCM_RIGHTS)               numbers, env, cwd, signals, stdio ─▶ runs argv
      forwards the signals it gets      ◀─ pid ──    waitpid(child)
      exits as the child did            ◀─ status ─  (client gone: the child's process group is killed)

The child runs the command as CPython's `main` would (`run_command`): `-m` through runpy's
`_run_module_as_main`, a script as a fresh `__main__`, then exits as the interpreter does
(non-daemon threads joined, exit handlers, open files flushed; an unhandled KeyboardInterrupt ends it
by SIGINT). What it cannot reproduce (an option other than -u / -B, a module of the working folder
shadowing one imported here, limits it cannot set) it refuses before running anything, and the client
then runs the real interpreter.

Run: python server.py DIR KEY (the client starts it; it exits when the process named by
$RLHFKIT_WARM_OWNER ends or DIR is removed; $RLHFKIT_WARM_PRELOAD=a,b replaces the modules imported ahead).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import logging
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types

import warm_keys as keys  # this file's folder is sys.path[0] (the child replaces it)
from warm_wire import recv_msg, send_msg

# imported ahead: what a rlhfkit command, a torchrun rank or a Ray actor of the tests imports first.
# Nothing here may import ray (its settings are read from RAY_* at import and are not part of the key).
PRELOAD = (
    "numpy", "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "torch.distributed.run", "torch.nn.attention.flex_attention",
    "safetensors.torch", "tokenizers", "transformers", "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.qwen3_vl.modeling_qwen3_vl", "peft", "matplotlib", "matplotlib.pyplot", "fastapi",
    "uvicorn", "aiohttp", "tqdm",
    "rlhfkit", "rlhfkit.cli.main", "rlhfkit.cli.common", "rlhfkit.cli.train_sft", "rlhfkit.cli.train_rm",
    "rlhfkit.cli.train_dpo", "rlhfkit.cli.train_kto", "rlhfkit.cli.train_prm", "rlhfkit.cli.train_kd",
    "rlhfkit.cli.train_ppo", "rlhfkit.rl_run.root", "rlhfkit.rl_run.local", "rlhfkit.rl_run.resolve",
    "rlhfkit.cli.batch_inference", "rlhfkit.cli.serve_rm",
    "rlhfkit.cli.make_data", "rlhfkit.cli.make_tiny_model", "rlhfkit.backend.fsdp2", "rlhfkit.roles",
    "rlhfkit.rollout.builtin", "rlhfkit.trainers", "rlhfkit.models.loader", "rlhfkit.models.tiny",
    "rlhfkit.agents.executors",
)
if os.environ.get("RLHFKIT_WARM_PRELOAD") is not None:  # the tests of this tool: a server that starts at once
    PRELOAD = tuple(m for m in os.environ["RLHFKIT_WARM_PRELOAD"].split(",") if m)
NEVER_PRELOADED = ("ray", "vllm", "wandb", "deepspeed")
FILE_TYPES = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)  # concrete: no isinstance hooks run


# ----------------------------------------------------------------------------- the server


class Refused(Exception):
    """The child cannot run this command as a fresh interpreter would; the client runs the real one."""


class Server:
    def __init__(self, directory: str, key: str) -> None:
        self.dir, self.key = directory, key
        self.owner = int(os.environ.get("RLHFKIT_WARM_OWNER", "0") or 0)
        self.children: dict[int, socket.socket] = {}  # child pid -> its client's connection
        self.traced: dict[int, str] = {}  # child pid -> its command line, with RLHFKIT_WARM_TRACE set
        self.conns: dict[int, socket.socket] = {}  # fileno -> connection whose request is awaited
        self.unfit = ""  # why this interpreter cannot fork faithfully (then it refuses every request)

    # imports and checks -------------------------------------------------------------

    def preload(self) -> None:
        # CPython's advice for a server that forks without exec: no collection here, everything frozen before
        # each fork, collection on again in the child (which then never walks or writes the server's objects)
        gc.disable()
        self.env = dict(os.environ)  # as started: the environment of the key
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - an optional package: the child imports (or fails to) itself
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        now = dict(os.environ)
        # what the imports set (torch's TORCHINDUCTOR_CACHE_DIR): a fresh process sets the same while importing
        self.env_changes = {k: now.get(k) for k in set(now) | set(self.env) if now.get(k) != self.env.get(k)}
        leaked = [m for m in NEVER_PRELOADED if m in sys.modules]
        if leaked:
            self.unfit = f"imported {leaked} ahead (its settings are not in the key)"

    def threads(self) -> int:
        return len(os.listdir("/proc/self/task"))

    # the loop -----------------------------------------------------------------------

    def serve(self) -> None:
        print(f"warmstart {self.key}: {sys.executable}, import-time environment {keys.import_env(dict(os.environ))}",
              flush=True)
        t0 = time.monotonic()
        self.preload()
        if not self.unfit and self.threads() != 1:
            self.unfit = f"{self.threads() - 1} thread(s) started while importing (OMP_NUM_THREADS unset?)"
        if self.unfit:  # no socket: every client of this key runs the real interpreter
            print(f"warmstart {self.key}: not serving: {self.unfit}", flush=True)
            return
        path = os.path.join(self.dir, self.key + ".sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = path + f".{os.getpid()}"
        listener.bind(tmp)
        listener.listen(64)
        os.rename(tmp, path)
        print(f"warmstart {self.key}: serving after {time.monotonic() - t0:.1f} s of imports", flush=True)
        self.listener = listener
        rd, wr = os.pipe()
        os.set_blocking(wr, False)
        os.set_blocking(rd, False)
        self.wake = (rd, wr)
        signal.set_wakeup_fd(wr)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self.stop(path))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while True:
            if (self.owner and not _alive(self.owner)) or not os.path.isdir(self.dir):
                self.stop(path)
            fds = [listener, rd, *self.conns.values(), *self.children.values()]
            try:
                ready, _, _ = select.select(fds, [], [], 1.0)
            except InterruptedError:
                ready = []
            for r in ready:
                try:
                    self.event(r)
                except Exception:  # noqa: BLE001 - one client's trouble never ends the server
                    traceback.print_exc()
                    sys.stdout.flush()
            self.reap()

    def event(self, r) -> None:
        if r is self.listener:
            conn, _ = self.listener.accept()
            self.conns[conn.fileno()] = conn
        elif r == self.wake[0]:
            try:
                os.read(r, 4096)
            except BlockingIOError:
                pass
        elif r.fileno() in self.conns:
            self.conns.pop(r.fileno())
            self.handle(r)
        else:  # a running child's client: its end of the stream (or a reset) means the client died
            try:
                gone = r.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                gone = True
            if gone:
                self.client_gone(r)

    def stop(self, path: str) -> None:
        for pid in list(self.children):
            _killpg(pid)
        try:
            os.unlink(path)
        except OSError:
            pass
        os._exit(0)

    def client_gone(self, conn: socket.socket) -> None:
        for pid, c in self.children.items():
            if c is conn:
                _killpg(pid)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if pid in self.traced:  # its CPU, with that of the children it waited for: a profile of the suite
                print(f"warmstart {self.key}: child {pid} ended ({status}) after "
                      f"{usage.ru_utime + usage.ru_stime:.2f} s of CPU: {self.traced.pop(pid)}", flush=True)
            if conn is not None:
                try:
                    send_msg(conn, {"status": status})
                except OSError:
                    pass
                conn.close()

    def handle(self, conn: socket.socket) -> None:
        try:
            req, fds = recv_msg(conn, with_fds=True)
        except OSError:
            conn.close()
            return
        if req is None:
            conn.close()
            return
        reason = "threads are running" if self.threads() != 1 else ""
        if reason:
            self.refuse(conn, fds, reason)
            return
        rd, wr = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            gc.enable()
            os.close(rd)
            self.child(conn, req, fds, wr)  # never returns
        os.close(wr)
        for fd in fds:
            os.close(fd)
        answer = _read_all(rd, timeout=30.0)
        os.close(rd)
        if answer == b"ok":
            self.children[pid] = conn  # from here on, what becomes of the child is reported (or it is killed)
            if req["env"].get("RLHFKIT_WARM_TRACE"):
                self.traced[pid] = " ".join(req["args"])[:300]
                print(f"warmstart {self.key}: child {pid}: {self.traced[pid][:200]}", flush=True)
            try:
                send_msg(conn, {"pid": pid})
            except OSError:
                _killpg(pid)  # the client is gone already
            return
        _killpg(pid)
        os.waitpid(pid, 0)
        self.refuse(conn, [], answer.decode(errors="replace") or "the child gave no answer")

    def refuse(self, conn: socket.socket, fds: list[int], reason: str) -> None:
        for fd in fds:
            os.close(fd)
        try:
            send_msg(conn, {"refused": reason})
        except OSError:
            pass
        conn.close()

    # the child ----------------------------------------------------------------------

    def child(self, conn: socket.socket, req: dict, fds: list[int], wr: int) -> None:
        for s in [self.listener, conn, *self.conns.values(), *self.children.values()]:
            s.detach()  # closed below with every other descriptor of the server: the objects must forget them
        try:
            os.setsid()
            wr = _move_high(wr)
            self.place_fds(req["fds"], fds, wr)
            prog = prepare(req, self.env, self.env_changes)
        except Refused as e:
            os.write(wr, str(e).encode())
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - any failure before the command runs: refuse
            os.write(wr, f"{type(e).__name__}: {e}".encode())
            os._exit(0)
        os.write(wr, b"ok")
        os.close(wr)
        run_command(prog)

    def place_fds(self, targets: list[int], got: list[int], wr: int) -> None:
        """The client's descriptors at their own numbers, and nothing of the server's left open."""
        if len(targets) != len(got):
            raise Refused("descriptors lost on the way")
        signal.set_wakeup_fd(-1)
        top = max([*targets, 2]) + 1
        high = [fcntl_dupfd(fd, max(top, 1024)) for fd in got]
        for fd in got:
            os.close(fd)
        keep = set(high) | {wr}
        for fd in _open_fds():
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        for src, dst in zip(high, targets):
            os.dup2(src, dst, inheritable=True)
            os.close(src)


def fcntl_dupfd(fd: int, lowest: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)


def _move_high(fd: int) -> int:
    new = fcntl_dupfd(fd, 2048)
    os.close(fd)
    return new


def _open_fds() -> list[int]:
    return [int(x) for x in os.listdir("/proc/self/fd")]


def _read_all(fd: int, timeout: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        out += chunk
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _killpg(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ----------------------------------------------------------------------------- the child's interpreter


class Program:
    def __init__(self, kind: str, target: str, argv0: str, rest: list[str], unbuffered: bool) -> None:
        self.kind, self.target, self.argv0, self.rest, self.unbuffered = kind, target, argv0, rest, unbuffered


def prepare(req: dict, started: dict[str, str], changes: dict[str, str | None]) -> Program:
    """Make this forked process look like a fresh interpreter started by the client (whose import-time
    environment must be `started`'s, and on which the imports made `changes`); the program to run."""
    parsed = keys.parse_command(req["args"])
    if parsed is None:
        raise Refused("command line")
    opts, kind, target, rest = parsed
    env = req["env"]
    if keys.import_env(env) != keys.import_env(started):
        raise Refused("import-time environment differs")
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    for name, (soft, hard) in req["rlimits"].items():
        res = getattr(resource, name)
        if resource.getrlimit(res) != (soft, hard):
            resource.setrlimit(res, (soft, hard))
    path0 = os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(target))
    _refuse_shadowing(path0)
    os.environ.clear()
    os.environ.update(env)
    for k, v in changes.items():
        if v is None:
            os.environ.pop(k, None)
        elif k not in env or keys.import_env({k: v}):
            os.environ[k] = v
    _reset_signals(set(req["ignored"]), set(req["blocked"]))
    unbuffered = "-u" in opts or bool(env.get("PYTHONUNBUFFERED"))
    if "-B" in opts or env.get("PYTHONDONTWRITEBYTECODE"):
        sys.dont_write_bytecode = True
    _new_stdio(unbuffered)
    sys.path[0] = path0
    sys.executable = req["executable"]
    sys.orig_argv = [req["executable"], *req["args"]]
    import tempfile

    tempfile.tempdir = None
    # a fresh process seeds torch's and numpy's global generators from the OS (Python's `random` reseeds at fork)
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if env.get("RLHFKIT_WARM_TRACE"):  # name the child after its program in ps / top (a real one is "python")
        _set_comm(target.rsplit(".", 1)[-1] if kind == "module" else os.path.basename(target))
    argv0 = "-m" if kind == "module" else target
    return Program(kind, target, argv0, rest, unbuffered)


def _set_comm(name: str) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _refuse_shadowing(path0: str) -> None:
    """A fresh interpreter would import a module of sys.path[0] before the installed one imported here
    (unless that is the very file imported here, as for a checkout's own folder)."""
    try:
        names = set(os.listdir(path0))
    except OSError:
        return
    clash = []
    for name, mod in list(sys.modules.items()):
        if "." in name or mod is None:
            continue
        here = [os.path.join(path0, name, "__init__.py")] if name in names else []
        here += [os.path.join(path0, n) for n in names if n == name + ".py" or n.startswith(name + ".") and n.endswith(".so")]
        here = [p for p in here if os.path.isfile(p)]
        loaded = getattr(mod, "__file__", None)
        if here and not (loaded and os.path.realpath(loaded) in {os.path.realpath(p) for p in here}):
            clash.append(name)
    if clash:
        raise Refused(f"{path0} holds {sorted(clash)}")


def _reset_signals(ignored: set[int], blocked: set[int]) -> None:
    """The dispositions CPython starts with (SIGINT raises KeyboardInterrupt; SIGPIPE, SIGXFSZ ignored),
    except what the client inherited as ignored; the client's blocked set."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig in ignored:
            handler = signal.SIG_IGN
        elif sig == signal.SIGINT:
            handler = signal.default_int_handler
        elif sig in (signal.SIGPIPE, signal.SIGXFSZ):
            handler = signal.SIG_IGN
        else:
            handler = signal.SIG_DFL
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _new_stdio(unbuffered: bool) -> None:
    """sys.stdin / stdout / stderr over descriptors 0-2 as CPython builds them at start-up (create_stdio),
    and the logging handlers that held the old ones pointed at the new ones."""
    old = {id(sys.stdout): 1, id(sys.stderr): 2, id(sys.__stdout__): 1, id(sys.__stderr__): 2}
    spec = {0: (sys.__stdin__, "<stdin>"), 1: (sys.__stdout__, "<stdout>"), 2: (sys.__stderr__, "<stderr>")}
    new = {}
    for fd, (was, name) in spec.items():
        try:
            os.fstat(fd)
        except OSError:
            new[fd] = None
            continue
        encoding = getattr(was, "encoding", None) or "utf-8"
        errors = getattr(was, "errors", None) or ("backslashreplace" if fd == 2 else "strict")
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        raw.name = name
        buffered = fd == 0 or not unbuffered
        binary = (io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)) if buffered else raw
        text = io.TextIOWrapper(binary, encoding=encoding, errors=errors, newline="\n",
                                line_buffering=fd != 0 and buffered and (fd == 2 or raw.isatty()),
                                write_through=unbuffered)
        text.mode = "r" if fd == 0 else "w"
        new[fd] = text
    sys.stdin = sys.__stdin__ = new[0]
    sys.stdout = sys.__stdout__ = new[1]
    sys.stderr = sys.__stderr__ = new[2]
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and id(h.stream) in old:
                h.stream = new[old[id(h.stream)]]


def run_command(prog: Program) -> None:
    """Run the program as CPython's main does and end the process as its finalization would."""
    code = 0
    interrupted = False
    try:
        if prog.kind == "module":
            import runpy

            for name in (prog.target, prog.target + ".__main__"):
                sys.modules.pop(name, None)  # imported ahead here, never before `-m` runs it in a fresh one
            sys.modules["__main__"] = _fresh_main()
            sys.argv = ["-m", *prog.rest]
            runpy._run_module_as_main(prog.target, alter_argv=True)
        else:
            sys.argv = [prog.argv0, *prog.rest]
            _run_script(prog.target)
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException as e:  # noqa: BLE001 - printed as the interpreter prints an unhandled exception
        interrupted = isinstance(e, KeyboardInterrupt)
        _print_unhandled(e)
        code = 1
    code = _finalize(code)
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _run_script(path: str) -> None:
    import importlib.machinery

    with open(path, "rb") as f:
        source = f.read()
    main = _fresh_main()
    main.__file__ = path
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    exec(compile(source, path, "exec"), main.__dict__)


def _fresh_main() -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__builtins__ = sys.modules["builtins"]
    return main


def _exit_status(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        print(value, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def _print_unhandled(e: BaseException) -> None:
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # this file's frames are not the program's
    e.__traceback__ = tb  # the hook prints the exception's own traceback
    try:
        sys.excepthook(type(e), e, tb)
    except Exception:  # noqa: BLE001
        traceback.print_exception(type(e), e, tb)


def _finalize(code: int) -> int:
    """What Py_FinalizeEx does that a program can see: non-daemon threads joined, exit handlers run,
    files still open flushed (their finalizers would), stdout and stderr flushed (a failed stdout flush
    is exit 120)."""
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        gc.collect()
    except BaseException as e:  # noqa: BLE001
        _print_unhandled(e)
    for obj in gc.get_objects():  # the child's own: the server's are frozen
        if issubclass(type(obj), FILE_TYPES) and obj is not sys.stdout and obj is not sys.stderr:
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001
                pass
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except Exception:  # noqa: BLE001
        code = code or 120
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    return code


if __name__ == "__main__":
    Server(sys.argv[1], sys.argv[2]).serve()
