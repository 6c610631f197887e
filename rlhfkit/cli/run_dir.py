"""One run per folder: every trainer's `run()` (SFT family and RL alike) is wrapped by `training_run`,
which holds the run's claim on its folders (`RunDirectory`) and its stop handling (SIGINT / SIGTERM:
rlhfkit.trainers.stop) while it runs.

    @training_run
    def run(args, ...): ...

On entry, all ranks: --ckpt_path, when not given, becomes `<run dir>/checkpoints` (the run
directory is --run_dir, default --save_path), so two runs never share checkpoints by default.

On entry, rank 0 (the driver under Ray), for each output folder (the run directory, --save_path,
--ckpt_path; one inside another is covered by it):

 1. writable: the folder is created and a file written and removed in it; an unwritable one is
    refused in one line naming its flag, before anything is loaded (a folder made here that the
    run leaves empty, e.g. when it fails on its flags, is removed again).
 2. locked: `<folder>/.rlhfkit-run.lock` is created exclusively and holds this run's pid, host,
    start time and command (secrets redacted). A folder locked by a live process is refused in
    one line naming that run; a lock left by a process that died (same host, pid gone or reused)
    is taken over with a note. The locks go when `run()` returns or raises.
 3. not another run's: an earlier run is there when the run directory has logged steps
    (metrics.jsonl), --save_path holds a saved model, or --ckpt_path holds checkpoints.
      --pretrain is --save_path a new run trains from the model there and replaces it, as OpenRLHF's
                                iterative scripts do: the earlier run's metrics.jsonl, metrics.png,
                                run_config.json and checkpoints inside the folder are moved to
                                `<run dir>/earlier_runs/<its start time>/` (with a note), so they
                                never mix with this run's
      --load_checkpoint         resumes it (a finished run too, e.g. with a larger --max_steps);
                                its run_config.json must record the same model, data, batch and
                                learning-rate settings (rlhfkit.trainers.run_settings), else the
                                flags that differ are named (--allow_resume_changes accepts them)
      --overwrite_output_dir    starts over: the earlier metrics.jsonl, metrics.png,
                                run_config.json and the checkpoints inside the run directory are
                                removed (a --ckpt_path outside it is never emptied: it is refused)
      neither                   refused in one line naming the folder and what it holds
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from rlhfkit.cli.common import UsageError
from rlhfkit.config.flags import run_dir_of
from rlhfkit.trainers import stop
from rlhfkit.trainers.run_settings import allowed_changes, check_same_run, run_settings

LOCK = ".rlhfkit-run.lock"
CHECKPOINTS = "checkpoints"
RECORDS = ("metrics.jsonl", "metrics.png", "run_config.json")
MODEL_MARKERS = ("config.json", "adapter_config.json")
F = TypeVar("F", bound=Callable[..., Any])


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def resolve_ckpt_path(args: argparse.Namespace) -> None:
    """--ckpt_path unset: `<run dir>/checkpoints`."""
    if getattr(args, "ckpt_path", "") is None:
        args.ckpt_path = os.path.join(run_dir_of(args), CHECKPOINTS)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def output_folders(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, folder) of the run's outputs, a folder inside an earlier one left out."""
    run_flag = "--run_dir" if getattr(args, "run_dir", None) else "--save_path"
    found: list[tuple[str, str]] = []
    for flag, path in ((run_flag, run_dir_of(args)), ("--save_path", args.save_path),
                       ("--ckpt_path", args.ckpt_path)):
        if path and not any(_inside(path, p) for _, p in found):
            found.append((flag, path))
    return found


def check_writable(flag: str, path: str) -> bool:
    """Create `path` and write a file in it; refuse it in one line naming `flag` if that fails.
    Returns whether `path` was created here."""
    probe = os.path.join(path, f".rlhfkit-write-test-{os.getpid()}.tmp")
    created = not os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path} is not writable: {e.strerror or e}") from None
    return created


# ----------------------------------------------------------------------------- the lock


def _proc_start(pid: int) -> str | None:
    """The boot id and start tick of process `pid` (Linux), to tell a reused pid; None elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


def _alive(info: dict[str, Any]) -> bool:
    """Whether the process that wrote lock `info` still runs (a lock of another host: assumed so)."""
    if info.get("host") != socket.gethostname():
        return True
    pid = int(info.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = info.get("proc_start")
    return start is None or _proc_start(pid) in (None, start)


def _read_lock(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


@dataclass
class RunLock:
    """`<folder>/.rlhfkit-run.lock`, held by this process until `release()`."""

    flag: str
    folder: str
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return os.path.join(self.folder, LOCK)

    def acquire(self, command: str) -> None:
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.info, f)
                f.flush()
                os.fsync(f.fileno())
            return
        self._refuse(_read_lock(self.path))

    def _take_over_if_stale(self) -> None:
        held = _read_lock(self.path)
        if held is None:  # empty or cut short: its writer died while writing (a live one writes at once)
            age = time.time() - os.path.getmtime(self.path) if os.path.exists(self.path) else 0.0
            if age < 5.0:
                self._refuse({})
        elif _alive(held):
            self._refuse(held)
        else:
            print(f"note: {self.flag} {self.folder}: taking over the lock of a run that ended without releasing "
                  f"it (pid {held.get('pid')} on {held.get('host')}, started {held.get('started')})", flush=True)
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def _refuse(self, held: dict[str, Any] | None) -> None:
        who = (f"pid {held.get('pid')} on {held.get('host')}, started {held.get('started')}" if held
               else "a run starting now")
        hint = (f"; if that run is gone, remove {self.path}" if held and held.get("host") != socket.gethostname()
                else "")
        raise UsageError(f"{self.flag} {self.folder} is in use by another run ({who}): wait for it to end or choose "
                         f"another {self.flag}{hint}")

    def release(self) -> None:
        held = _read_lock(self.path)
        if held is not None and held.get("pid") == self.info.get("pid") and held.get("host") == self.info.get("host"):
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


# ----------------------------------------------------------------------------- earlier runs


def _logged_steps(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _has_model(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, m)) for m in MODEL_MARKERS)


def _has_checkpoints(path: str, depth: int = 3) -> bool:
    """A `latest` pointer or a checkpoint's meta.json within `depth` levels of `path`."""
    if depth < 0 or not os.path.isdir(path):
        return False
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name in ("latest", "meta.json") and os.path.isfile(full):
            return True
        if os.path.isdir(full) and _has_checkpoints(full, depth - 1):
            return True
    return False


def earlier_run(args: argparse.Namespace) -> list[str]:
    """What the output folders hold of an earlier run (empty: nothing)."""
    run_dir, out = run_dir_of(args), []
    steps = _logged_steps(run_dir)
    if steps:
        out.append(f"{steps} logged steps in {os.path.join(run_dir, 'metrics.jsonl')}")
    if _has_model(args.save_path):
        out.append(f"a saved model in {args.save_path}")
    if _has_checkpoints(args.ckpt_path):
        out.append(f"checkpoints in {args.ckpt_path}")
    return out


def _start_over(args: argparse.Namespace) -> None:
    """--overwrite_output_dir: remove the earlier run's records and the checkpoints inside the run directory."""
    run_dir = run_dir_of(args)
    if _has_checkpoints(args.ckpt_path) and not _inside(args.ckpt_path, run_dir):
        raise UsageError(f"--overwrite_output_dir: --ckpt_path {args.ckpt_path} holds checkpoints of an earlier run "
                         "and lies outside the run directory: it is never emptied; remove them or choose another "
                         "--ckpt_path")
    removed = []
    for name in RECORDS:
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            os.remove(path)
            removed.append(name)
    if _has_checkpoints(args.ckpt_path):
        shutil.rmtree(args.ckpt_path)
        os.makedirs(args.ckpt_path)
        removed.append(f"the checkpoints in {args.ckpt_path}")
    if removed:
        print(f"note: --overwrite_output_dir: removed the earlier run's {', '.join(removed)} in {run_dir}", flush=True)


def _same_folder(a: str, b: str) -> bool:
    return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)


def _set_aside(args: argparse.Namespace) -> None:
    """--pretrain is --save_path: move the earlier run's records (and the checkpoints inside the run
    directory) to `<run dir>/earlier_runs/<its start time>/`."""
    run_dir = run_dir_of(args)
    if _has_checkpoints(args.ckpt_path) and not _inside(args.ckpt_path, run_dir):
        raise UsageError(f"--ckpt_path {args.ckpt_path} holds checkpoints of an earlier run: resume it with "
                         "--load_checkpoint or choose another --ckpt_path")
    moving = [os.path.join(run_dir, n) for n in RECORDS if os.path.isfile(os.path.join(run_dir, n))]
    if _has_checkpoints(args.ckpt_path):
        moving.append(args.ckpt_path)
    if not moving:
        return
    first = os.path.join(run_dir, "run_config.json")
    started = os.path.getmtime(first) if os.path.isfile(first) else time.time()
    dest = os.path.join(run_dir, "earlier_runs", time.strftime("%Y%m%d-%H%M%S", time.localtime(started)))
    while os.path.exists(dest):
        dest += "+"
    os.makedirs(dest)
    for path in moving:
        os.replace(path, os.path.join(dest, os.path.basename(path)))
    print(f"note: --save_path {args.save_path} is --pretrain: this run trains from the model there and replaces "
          f"it; the earlier run's {', '.join(os.path.basename(p) for p in moving)} moved to {dest}", flush=True)


def check_earlier_run(args: argparse.Namespace) -> None:
    """Refuse, resume or start over an earlier run in the output folders (module docstring, step 3)."""
    overwrite, resume = getattr(args, "overwrite_output_dir", False), getattr(args, "load_checkpoint", False)
    if overwrite and resume:
        raise UsageError("--overwrite_output_dir starts the run over and --load_checkpoint resumes it: give one")
    held = earlier_run(args)
    if not held:
        return
    if overwrite:
        _start_over(args)
        return
    if not resume and getattr(args, "pretrain", None) and _same_folder(args.pretrain, args.save_path):
        _set_aside(args)
        return
    run_flag = "--run_dir" if getattr(args, "run_dir", None) else "--save_path"
    if not resume:
        raise UsageError(f"{run_flag} {run_dir_of(args)} holds an earlier run ({'; '.join(held)}): resume it with "
                         f"--load_checkpoint, start over with --overwrite_output_dir, or choose another {run_flag}")
    if not (_logged_steps(run_dir_of(args)) or _has_model(args.save_path)):
        return  # the run directory's run_config.json, if any, is of an attempt that never trained
    saved = _read_config(os.path.join(run_dir_of(args), "run_config.json"))
    check_same_run(run_settings(saved), run_settings(vars(args)),
                   allowed_changes(getattr(args, "allow_resume_changes", None)),
                   f"the run in {run_flag} {run_dir_of(args)}")


def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ----------------------------------------------------------------------------- the wrapper


class RunDirectory:
    """The claim of one run on its output folders (module docstring); a context manager."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.locks: list[RunLock] = []
        self.created: list[str] = []  # folders made here: removed again if the run leaves them empty

    def __enter__(self) -> "RunDirectory":
        resolve_ckpt_path(self.args)
        if not _rank0():
            return self
        from rlhfkit.trainers.model_card import this_command

        folders = output_folders(self.args)
        try:
            for flag, path in folders:
                if check_writable(flag, path):
                    self.created.append(path)
            for flag, path in folders:
                lock = RunLock(flag, path)
                lock.acquire(this_command())
                self.locks.append(lock)
            check_earlier_run(self.args)
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        while self.locks:
            self.locks.pop().release()
        while self.created:  # a run that failed before writing anything leaves no empty folder behind
            try:
                os.rmdir(self.created.pop())
            except OSError:
                pass

    def __exit__(self, *exc: Any) -> None:
        self.release()


def resume_command() -> str:
    """This run's command line with --load_checkpoint (and without --overwrite_output_dir)."""
    from rlhfkit.trainers.model_card import this_command

    argv = [a for a in sys.argv[1:] if a not in ("--overwrite_output_dir", "--ckpt.overwrite_output_dir")]
    if not any(a in ("--load_checkpoint", "--ckpt.load_enable") for a in argv):
        argv.append("--load_checkpoint")
    return this_command(argv)


def training_run(run: F) -> F:
    """Wrap a trainer's `run(args, ...)`: its `RunDirectory` claim and its stop handling (a stopped run
    raises RunStopped whose line ends with the command that resumes it)."""

    @functools.wraps(run)
    def wrapped(args: argparse.Namespace, *rest: Any, **kw: Any) -> Any:
        with RunDirectory(args), stop.active(grace_s=getattr(args, "stop_grace_s", 10.0),
                                             can_abandon=os.environ.get("WORLD_SIZE", "1") == "1") as signals:
            try:
                out = run(args, *rest, **kw)
            except stop.RunStopped as e:
                if e.saved:
                    raise stop.RunStopped(e.signum, f"{e}; resume with: {resume_command()}", e.saved) from None
                raise
            if signals.signum and _rank0():
                print(f"note: {signals.name} came after the last step; the run finished", flush=True)
            return out

    return wrapped  # type: ignore[return-value]
