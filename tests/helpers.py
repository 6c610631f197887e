"""Helpers the tests share (importable as `helpers`: tests/ is on sys.path through its conftest):
a command, or a shell script's rlhfkit commands, run in this process (run_cli, run_shell), a free port,
the subprocess environment for what runs as a process (torchrun, a server, a signalled run), the RL tests'
reward files, data, flag list and run reader, and JSON over HTTP.

A test runs a command in its own process unless the process is what it tests: signals and exit statuses,
a lock held by another live process, a hang that only a kill ends, torchrun ranks, Ray, a server, what a
fresh interpreter imports, or environment variables read when a library is imported."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import io
import json
import logging
import os
import random
import runpy
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import traceback
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from typing import IO

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the fraction of even-numbered characters in a completion (`query` minus its `prompt`): rises when GRPO works,
# never constant. Reward files paste EVEN_FRACTION_DEF and wrap it (even_reward_src, or their own reward_func).
EVEN_FRACTION_DEF = '''
def even_fraction(query, prompt):
    c = query[len(prompt):]
    return sum(ord(ch) % 2 == 0 for ch in c) / max(len(c), 1)
'''


def even_reward_src(scores: bool = True, extra_logs: bool = False, prefix: str = "", before: str = "") -> str:
    """A reward file whose reward_func returns {"rewards": even fractions} (+ the same as "scores", + them as
    extra_logs["even_frac"]); `prefix` is module code before it (imports, state), `before` lines run first in
    reward_func (4-space indented)."""
    ret = '{"rewards": rewards'
    ret += ', "scores": rewards' if scores else ""
    ret += ', "extra_logs": {"even_frac": rewards}' if extra_logs else ""
    return (prefix + EVEN_FRACTION_DEF + "\n\ndef reward_func(queries, prompts, labels):\n" + before
            + "    rewards = [even_fraction(q, p) for q, p in zip(queries, prompts)]\n"
            + "    return " + ret + "}\n")


EVEN_REWARD = even_reward_src(scores=True, extra_logs=True)


def length_reward_src(before: str = "") -> str:
    """A reward file whose reward_func returns a plain list: the query's length mod 3, halved (0, 0.5 or 1: never
    constant over a group); `before` lines run first (4-space indented)."""
    return ("def reward_func(queries, prompts, labels):\n" + before
            + "    return [len(q) % 3 / 2.0 for q in queries]\n")


# even digits in the completion, over 3
DIGIT_REWARD = '''
def reward_func(queries, prompts, labels):
    rewards = [sum(ch in "02468" for ch in q[len(p):]) / 3.0 for q, p in zip(queries, prompts)]
    return {"rewards": rewards, "scores": rewards}
'''


@dataclasses.dataclass
class CliResult:
    """What `python -m <module> <args>` would have given: exit status, stdout and stderr."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_cli(module: str, argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
            stdin: str = "", merge_stderr: bool = False, terminal: tuple[int, int] | None = None) -> CliResult:
    """Run `python -m module argv` in this process: the module's `main(argv)` (a package's __main__; `module` a
    .py file: `python FILE argv`, the file run as __main__), with `env` added to the environment, `cwd` as the
    working folder, `stdin` as standard input, and file descriptors 1 and 2 captured, so the output of the
    processes the run starts (reward workers, say) is captured too. `merge_stderr`: both into stdout in the order
    written, as `2>&1` does; `terminal` (columns, rows): standard input and output on a pseudo-terminal of that
    size, all of whose output is stdout.

    The exit status is the interpreter's: 0 when main returns, SystemExit's code, 1 with the traceback on stderr
    for any other exception. What a run changes in the process ends with it (_process_state): the environment,
    the working folder, sys.argv and sys.path, the logging handlers and rlhfkit.logs' console, warnings filters
    and showwarning, SIGINT/SIGTERM/SIGHUP/SIGUSR1 handlers, torch's default dtype, threads, determinism and
    matmul precision, and the torch, random and numpy generators. The run sees rlhfkit.logs as a fresh
    interpreter has it (no console handler yet). Not undone: modules it imported, threads or processes it left
    running."""
    env = {**os.environ, **(env or {})}
    if terminal is not None:
        return _run_on_a_terminal(module, argv, env, cwd or os.getcwd(), *terminal)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code = _run_main(module, argv, env, cwd or os.getcwd(), io.StringIO(stdin),
                         out.fileno(), (out if merge_stderr else err).fileno())
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    return CliResult([module, *map(str, argv)], code, *texts)


def _run_on_a_terminal(module: str, argv: Sequence[str], env: dict[str, str], cwd: str, cols: int,
                       rows: int) -> CliResult:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:  # until every writer has closed the terminal (EIO), or the master is closed
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 65536):
                chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        with open(slave, encoding="utf-8", closefd=False) as stdin:
            code = _run_main(module, argv, env, cwd, stdin, slave, slave)
    finally:
        os.close(slave)
        reader.join(timeout=30)
        os.close(master)
    return CliResult([module, *map(str, argv)], code, b"".join(chunks).decode("utf-8", errors="replace"), "")


def _run_main(module: str, argv: Sequence[str], env: dict[str, str], cwd: str, stdin: IO[str], out_fd: int,
              err_fd: int, argv0: str | None = None) -> int:
    """`module.main(argv)` (a .py file: the file as __main__) with this environment, working folder and standard
    streams (descriptors 1 and 2 pointed at `out_fd` and `err_fd`); its exit status (run_cli)."""
    argv = [str(a) for a in argv]
    if module.endswith(".py"):
        path = os.path.join(cwd, module)
        main, argv0 = (lambda: runpy.run_path(module, run_name="__main__")), argv0 or module
    else:
        mod = importlib.import_module(module)
        if not hasattr(mod, "main") and hasattr(mod, "__path__"):  # a package: `python -m` runs its __main__
            mod = importlib.import_module(module + ".__main__")
        main, argv0 = (lambda: mod.main(argv)), argv0 or getattr(mod, "__file__", None) or module
    with _process_state(), _standard_streams(stdin, out_fd, err_fd):
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [argv0, *argv]
        if module.endswith(".py"):
            sys.path.insert(0, os.path.dirname(path))  # as `python FILE` has it
        try:
            main()
            return 0
        except SystemExit as e:
            return _exit_status(e.code)
        except Exception:  # noqa: BLE001 - the interpreter prints it and exits 1
            traceback.print_exc()
            return 1
        finally:
            from rlhfkit import logs

            logs.close_run_logs()


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


@contextlib.contextmanager
def _standard_streams(stdin: IO[str], out_fd: int, err_fd: int) -> Iterator[None]:
    """sys.stdin reads `stdin`; descriptors 1 and 2, and sys.stdout and sys.stderr on them, write to `out_fd`
    and `err_fd` (processes started meanwhile inherit them)."""
    streams = sys.stdin, sys.stdout, sys.stderr
    for s in streams[1:]:
        s.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdin = stdin
        line = 1 if out_fd == err_fd else -1  # one file for both: whole lines in the order written
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=line)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
        yield
    finally:
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                s.flush()
        sys.stdin, sys.stdout, sys.stderr = streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


# A shell script run by run_shell finds these first on PATH as python, python3 and rlhfkit: an rlhfkit command
# (`python -m rlhfkit.cli.X`, `python -m rlhfkit.examples`, `rlhfkit X`) is handed to the test's process through
# files in RK_SHELL_DIR (<pid>.req: working folder, module, arguments; <pid>.env: the environment) and runs
# there, writing to FIFOs that cat copies to the shim's own stdout and stderr; the shim exits with its status.
# Anything else is the real interpreter.
_SHIM = r"""#!/bin/sh
d="$RK_SHELL_DIR"
if [ "$(basename "$0")" = rlhfkit ]; then
    mod=rlhfkit
elif [ "$1" = -m ]; then
    case "$2" in
        rlhfkit.cli.*|rlhfkit.examples) mod="$2"; shift 2 ;;
        *) exec "$RK_SHELL_PYTHON" "$@" ;;
    esac
else
    exec "$RK_SHELL_PYTHON" "$@"
fi
id=$$
mkfifo "$d/$id.o" "$d/$id.e" "$d/$id.done"
cat "$d/$id.o" &
o=$!
cat "$d/$id.e" >&2 &
e=$!
printf '%s\0' "$PWD" "$mod" "$@" > "$d/$id.args"
env -0 > "$d/$id.env"
mv "$d/$id.args" "$d/$id.req"
read -r status < "$d/$id.done"
wait $o $e
rm -f "$d/$id.o" "$d/$id.e" "$d/$id.done" "$d/$id.env"
exit "$status"
"""


def run_shell(args: list[str], cwd: str, env: dict[str, str], timeout: float, stdin: str | None = None,
              log: IO | None = None) -> subprocess.CompletedProcess:
    """Run `args` (bash and a script, say) with the rlhfkit commands it starts run in this process (run_cli), each
    with the shell's working folder, environment, standard input and output at that point, and its exit status
    given back to the shell; torchrun, Ray and any other program stay processes of their own. Output goes to
    `log` (stdout and stderr both) or is captured; the whole process group is killed after `timeout` seconds
    (TimeoutExpired)."""
    with tempfile.TemporaryDirectory(prefix="rk-sh-") as d, tempfile.TemporaryFile() as inp, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        bin_dir = os.path.join(d, "bin")
        os.makedirs(bin_dir)
        for name in ("python", "python3", "rlhfkit"):
            with open(os.path.join(bin_dir, name), "w") as f:
                f.write(_SHIM)
            os.chmod(os.path.join(bin_dir, name), 0o755)
        inp.write((stdin or "").encode())
        inp.seek(0)
        env = {**env, "RK_SHELL_DIR": d, "RK_SHELL_PYTHON": sys.executable,
               "PATH": bin_dir + os.pathsep + env.get("PATH", "")}
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=inp if stdin is not None else subprocess.DEVNULL,
                                stdout=log or out, stderr=log or err, start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while True:
                requests = sorted(n for n in os.listdir(d) if n.endswith(".req"))
                for name in requests:
                    _serve(d, int(name.removesuffix(".req")))
                if not requests and proc.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(args, timeout)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess(args, proc.returncode, *texts)


def _serve(d: str, pid: int) -> None:
    """Run the command the shim `pid` asked for (run_shell), on its streams; tell it the exit status."""
    with open(os.path.join(d, f"{pid}.req"), "rb") as f:
        cwd, module, *argv = (x.decode() for x in f.read().split(b"\0")[:-1])
    with open(os.path.join(d, f"{pid}.env"), "rb") as f:
        env = dict(x.decode().split("=", 1) for x in f.read().split(b"\0") if b"=" in x)
    os.remove(os.path.join(d, f"{pid}.req"))
    env.pop("RK_SHELL_DIR", None)
    argv0 = None
    if module == "rlhfkit":  # the console script: `rlhfkit CMD ...` is rlhfkit.cli.<COMMANDS[CMD]> ...
        from rlhfkit.cli.main import COMMANDS

        if argv and argv[0] in COMMANDS:
            module, argv0, argv = f"rlhfkit.cli.{COMMANDS[argv[0]]}", f"rlhfkit {argv[0]}", argv[1:]
        else:
            module = "rlhfkit.cli.main"
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)  # a pipe whose writer is gone: no wait
    os.set_blocking(fd, True)
    with open(fd, encoding="utf-8") as stdin, open(os.path.join(d, f"{pid}.o"), "wb") as out, \
            open(os.path.join(d, f"{pid}.e"), "wb") as err:
        code = _run_main(module, argv, env, cwd, stdin, out.fileno(), err.fileno(), argv0)
    with open(os.path.join(d, f"{pid}.done"), "w") as f:
        f.write(f"{code}\n")


_LOGGERS = ("", "rlhfkit", "transformers", "py.warnings")


@contextlib.contextmanager
def _process_state() -> Iterator[None]:
    """Restore, on the way out, what a command changes in its process (run_cli's docstring); on the way in,
    rlhfkit.logs without a console handler, as a fresh interpreter has it."""
    from rlhfkit import logs

    env, cwd, argv, path = dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path)
    loggers = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in map(logging.getLogger, _LOGGERS)]
    log_state = {k: getattr(logs, k) for k in ("_console", "_early", "_verbose", "_debug", "_hidden_noted")}
    showwarning = warnings.showwarning, getattr(logging, "_warnings_showwarning", None)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    torch_state = (torch.get_default_dtype(), torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision())
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    for lg, hs, _, _ in loggers:  # the console handler of an earlier run in this process is not this run's
        lg.handlers[:] = [h for h in hs if h not in (logs._console, logs._early)]
    logs._console = logs._early = None
    try:
        with warnings.catch_warnings():
            yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv, sys.path[:] = argv, path
        for lg, hs, level, propagate in loggers:
            lg.handlers[:] = hs
            lg.setLevel(level)
            lg.propagate = propagate
        for k, v in log_state.items():
            setattr(logs, k, v)
        warnings.showwarning = showwarning[0]
        logging._warnings_showwarning = showwarning[1]  # type: ignore[attr-defined]
        for s, h in handlers.items():
            if h is not None:
                signal.signal(s, h)
        torch.set_default_dtype(torch_state[0])
        torch.set_num_threads(torch_state[1])
        torch.use_deterministic_algorithms(torch_state[2], warn_only=torch_state[3])
        torch.set_float32_matmul_precision(torch_state[4])
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_pid(port: int) -> int | None:
    """The pid of this machine's process listening on TCP `port` (Linux /proc), None when none is found: the
    server itself, also when a launcher stands between it and us."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # state 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else ()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                return int(pid)
        except OSError:
            continue
    return None


def pythonpath(*dirs: str) -> str:
    """PYTHONPATH with `dirs` first, then this process's entries; no empty entry (one would put the
    child's working folder on its sys.path)."""
    parts = [*dirs, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child process running this checkout's rlhfkit (no torchrun variables
    inherited, one thread per process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    """`python -m torch.distributed.run --nproc_per_node nproc` on a free local port, then `args`."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *args]


def write_rl_data(d: str, num_prompts: int = 12, reward_src: str = EVEN_REWARD, seed: int = 7) -> str:
    """`d/prompts.jsonl` (2-digit additions: input, label) and `d/reward.py`; returns `d`."""
    from rlhfkit.tasks.addition import addition_splits

    rows, _ = addition_splits(num_prompts, 2, seed=seed)
    with open(os.path.join(d, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"input": r["input"], "label": r["label"]}) + "\n" for r in rows)
    with open(os.path.join(d, "reward.py"), "w") as f:
        f.write(reward_src)
    return d


def cli_flags(**kw) -> list[str]:
    """`--name value` per keyword, in order: True gives the bare flag, None or False leaves it out, a list or
    tuple gives several values (`--critic.adam.betas 0.8 0.9`); a dotted flag is spelled with "__"."""
    out: list[str] = []
    for name, value in kw.items():
        if value is None or value is False:
            continue
        out.append("--" + name.replace("__", "."))
        if value is True:
            continue
        out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out


# the RL tests' common run: GRPO (group_norm) on CPU, 2 samples of 4 prompts a step, completions of 6 tokens
RL_BASE = dict(input_key="input", label_key="label", advantage_estimator="group_norm", n_samples_per_prompt=2,
               rollout_batch_size=4, train_batch_size=8, micro_train_batch_size=2, generate_max_len=6,
               prompt_max_len=16, disable_progress=True, device="cpu")


def ppo_flags(model: str, prompts: str, save: str, *extra: str, reward: str | None = None, **kw) -> list[str]:
    """train_ppo's command line: --pretrain model, --prompt_data prompts, --remote_rm_url reward (if given),
    RL_BASE updated by `kw` (None drops a flag of RL_BASE), --save_path save, then `extra` (last: it wins)."""
    head = ["--pretrain", model, "--prompt_data", prompts] + (["--remote_rm_url", reward] if reward else [])
    return [*head, *cli_flags(**{**RL_BASE, **kw}), "--save_path", save, *extra]


def rl_flags(model: str, d: str, save: str, *extra: str, steps: int = 2) -> list[str]:
    """GRPO on the tiny model: 4 prompts x 2 samples a step, one optimizer step per RL step, KL as a
    loss against a reference model, the builtin engine on CPU (the RL equivalence tests' run), on the
    prompts and reward file of write_rl_data(d)."""
    return ppo_flags(model, os.path.join(d, "prompts.jsonl"), save, *extra, reward=os.path.join(d, "reward.py"),
                     max_steps=steps, init_kl_coef="0.01", use_kl_loss=True, actor_learning_rate="1e-3",
                     lr_warmup_ratio=0)


def read_run(save: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """(metrics.jsonl records, final weights) of a run directory."""
    from safetensors.torch import load_file

    with open(os.path.join(save, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return recs, load_file(os.path.join(save, "model.safetensors"))


def post_json(url: str, body: bytes, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())
