"""One run per folder: the claim of a run on its output folders (`RunDirectory`, a context manager),
which every trainer's `run()` (SFT family and RL alike) holds while it runs: rlhfkit.cli.run_dir's
`training_run` wraps it, with its stop handling (SIGINT / SIGTERM: rlhfkit.trainers.stop).

    with RunDirectory(args): ...

On entry, all ranks: --ckpt_path, when not given, becomes `<run dir>/checkpoints` (the run
directory is --run_dir, default --save_path), so two runs never share checkpoints by default.

On entry, rank 0 (the driver under Ray), for each output folder (the run directory, --save_path,
--ckpt_path; one inside another is covered by it):

 1. writable: the folder is created and a file written and removed in it; an unwritable one is
    refused in one line naming its flag, before anything is loaded (a folder made here that the
    run leaves empty, e.g. when it fails on its flags, is removed again).
 2. locked: `<folder>/.rlhfkit-run.lock` is created exclusively and holds this run's pid, host,
    start time, command (secrets redacted) and a token shared by this run's locks. A lock covers its
    folder and everything inside it: a folder locked by another live run, inside one (a lock in a
    folder above), or holding one (a lock in a folder up to NESTED_DEPTH levels below; hidden and
    checkpoint folders are not searched) is refused in one line naming that run's pid and command.
    The folders are searched before anything is made (so a refused run never touches the live
    run's folder) and again once this run's locks are in place (two runs starting together: at
    least one sees the other). A lock left by a process that died (same host, pid gone or reused)
    is taken over with a note in its own folder and ignored above and below. The locks go when
    `run()` returns or raises.
 3. not another run's: an earlier run is there when the run directory has logged steps
    (metrics.jsonl), --save_path holds a saved model, or --ckpt_path holds checkpoints.
      --pretrain is --save_path a new run trains from the model there and replaces it, as OpenRLHF's
                                iterative scripts do: the earlier run's records (RECORDS) and its
                                checkpoints inside the folder are moved to
                                `<run dir>/earlier_runs/<its start time>/` (with a note), so they
                                never mix with this run's
      --load_checkpoint         resumes it (a finished run too, e.g. with a larger --max_steps);
                                its run_config.json must record the same model, data, batch and
                                learning-rate settings (rlhfkit.trainers.run_settings), else the
                                flags that differ are named (--allow_resume_changes accepts them)
      --overwrite_output_dir    starts over: the earlier records (RECORDS) and the checkpoints
                                inside the run directory are removed (a --ckpt_path outside it is
                                never emptied: it is refused)
      neither                   refused in one line naming the folder, what it holds and the flags
                                that lead on from there (--load_checkpoint only when --ckpt_path
                                holds a checkpoint to resume)

--load_checkpoint resumes when --ckpt_path holds a checkpoint (`has_resumable`); when it holds none, the
run is a new run (with a note) as in OpenRLHF, whose scripts pass the flag on first runs too, unless
the output folders hold an earlier run: then it is refused in one line (a run that asked to go on never
starts over from --pretrain and replaces an earlier run's model and metrics), except where --pretrain
is --save_path, which is handled as without the flag.

Moved or removed is only what runs of rlhfkit write (`checkpoint_entries`: `latest`, the
`global_step<N>` checkpoints with their `_hf` snapshots and `.tmp` leftovers, RL's actor/,
critic/ and best/ folders of them; the records by name), never other files of those folders, and
never a lock: --ckpt_path may be --save_path itself, next to the user's own files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from rlhfkit.config.errors import UsageError
from rlhfkit.fileio import read_json_object
from rlhfkit.config.flags import run_dir_of
from rlhfkit.trainers.run_settings import allowed_changes, check_same_run, run_settings

LOCK = ".rlhfkit-run.lock"
CHECKPOINTS = "checkpoints"
RECORDS = ("metrics.jsonl", "metrics.png", "completions.jsonl", "run_config.json", "train.log")
MODEL_MARKERS = ("config.json", "adapter_config.json")
POINTERS = ("latest", "latest.tmp")  # rlhfkit.checkpoint.layout: `latest`, rewritten through latest.tmp
CHECKPOINT_DIR = re.compile(r"global_step\d+(_hf)?((\.del|\.old)?\.tmp)?")  # a checkpoint, its HF snapshot, leftovers
RESUMABLE = re.compile(r"global_step\d+")  # a checkpoint a run goes on from
ROLE_FOLDERS = ("actor", "critic", "best")  # RL: one checkpoint folder per trained role; the best checkpoint
NESTED_DEPTH = 4  # levels below an output folder searched for another run's lock
YOUNG_LOCK_S = 5.0  # an unreadable lock younger than this is being written by a run starting now


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


def _young(path: str) -> bool:
    """Whether lock file `path` was made less than YOUNG_LOCK_S ago (a live run writes its lock at once)."""
    try:
        return time.time() - os.path.getmtime(path) < YOUNG_LOCK_S
    except OSError:
        return False


def _describe(held: dict[str, Any] | None) -> str:
    """The run that wrote lock `held`, in one line: pid, host, start time and command."""
    if not held:
        return "a run starting now"
    who = f"pid {held.get('pid')} on {held.get('host')}, started {held.get('started')}"
    command = held.get("command")
    if command:
        who += ", command: " + str(command).replace("\r", "\\r").replace("\n", "\\n")
    return who


def _gone_hint(held: dict[str, Any] | None, lock_path: str) -> str:
    """A lock of another host is never judged dead here: say which file to remove once that run is gone."""
    return f"; if that run is gone, remove {lock_path}" if held and held.get("host") != socket.gethostname() else ""


def _locks_below(folder: str, depth: int) -> Iterator[str]:
    """Lock files in the folders below `folder`, `depth` levels deep (links, hidden folders and checkpoints
    not entered)."""
    if depth <= 0:
        return
    try:
        with os.scandir(folder) as found:
            subs = sorted(e.path for e in found if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
                          and not CHECKPOINT_DIR.fullmatch(e.name))
    except OSError:
        return
    for sub in subs:
        if os.path.isfile(os.path.join(sub, LOCK)):
            yield os.path.join(sub, LOCK)
        yield from _locks_below(sub, depth - 1)


def _locks_around(folder: str) -> Iterator[str]:
    """Lock files that cover `folder` (in each folder above it) or that it would cover (below it)."""
    real = os.path.realpath(folder)
    up = os.path.dirname(real)
    while True:
        if os.path.isfile(os.path.join(up, LOCK)):
            yield os.path.join(up, LOCK)
        if os.path.dirname(up) == up:
            break
        up = os.path.dirname(up)
    yield from _locks_below(real, NESTED_DEPTH)


def refuse_if_shared(flag: str, folder: str, token: str) -> None:
    """Refuse `folder` (of `flag`) in one line when a folder above or below it is locked by another live run
    (a lock holding `token` is this run's own)."""
    for lock_path in _locks_around(folder):
        held = _read_lock(lock_path)
        if held is None and not _young(lock_path):
            continue  # cut short by a writer that died
        if held is not None and (held.get("token") == token or not _alive(held)):
            continue
        other = os.path.dirname(lock_path)
        how = "holds" if _inside(other, folder) else "is inside"
        whose = f"a live run ({_describe(held)})" if held else _describe(held)
        raise UsageError(f"{flag} {folder} {how} {other}, the folder of {whose}: wait for it to end or choose "
                         f"another {flag}{_gone_hint(held, lock_path)}")


@dataclass
class RunLock:
    """`<folder>/.rlhfkit-run.lock`, held by this process until `release()`."""

    flag: str
    folder: str
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return os.path.join(self.folder, LOCK)

    def acquire(self, command: str, token: str) -> None:
        """Create the lock (`token`: the same in every lock of this run) or refuse the folder in one line."""
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command, "token": token}
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
            if _young(self.path):
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
        raise UsageError(f"{self.flag} {self.folder} is in use by another run ({_describe(held)}): wait for it to end "
                         f"or choose another {self.flag}{_gone_hint(held, self.path)}")

    def release(self) -> None:
        held = _read_lock(self.path)
        if held is not None and held.get("token") == self.info.get("token"):
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


def checkpoint_entries(root: str) -> list[str]:
    """What runs of rlhfkit write in checkpoint folder `root` (rlhfkit.checkpoint.sharded,
    rlhfkit.trainers.rl_checkpoint): the `latest` pointer, `global_step<N>` checkpoints, their `_hf`
    snapshots and the `.tmp` leftovers of killed saves, and RL's actor/, critic/ and best/ folders of the
    same. Nothing else in `root` is a run's (links neither): --ckpt_path may be a folder of the user's."""
    if not os.path.isdir(root):
        return []
    found: list[str] = []
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        if os.path.islink(full):
            continue
        if (name in POINTERS and os.path.isfile(full)) or (CHECKPOINT_DIR.fullmatch(name) and os.path.isdir(full)):
            found.append(full)
        elif name in ROLE_FOLDERS and os.path.isdir(full):
            found += checkpoint_entries(full)
    return found


def has_resumable(ckpt: str) -> bool:
    """Whether checkpoint folder `ckpt` holds a checkpoint that --load_checkpoint goes on from: a
    `global_step<N>` folder in it (offline trainers) or in its actor/ (RL). One cut short counts too: loading
    names what it lacks. `latest`, Hugging Face snapshots (`_hf`) and leftovers of killed saves do not."""
    for root in (ckpt, os.path.join(ckpt, ROLE_FOLDERS[0])):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        if any(RESUMABLE.fullmatch(n) and os.path.isdir(os.path.join(root, n)) for n in names):
            return True
    return False


def _has_checkpoints(path: str) -> bool:
    """A checkpoint of a run in `path` (leftovers of killed saves alone are none: they are never loaded)."""
    return any(not e.endswith(".tmp") for e in checkpoint_entries(path))


def _prune_role_folders(root: str) -> None:
    """Remove RL's actor/, critic/, best/ folders under `root` that moving or removing checkpoints left empty."""
    for name in ROLE_FOLDERS:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            _prune_role_folders(path)
            try:
                os.rmdir(path)
            except OSError:
                pass  # holds something else: kept


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
    """--overwrite_output_dir: remove the earlier run's records and the checkpoints inside the run directory
    (what runs of rlhfkit write, nothing else: module docstring)."""
    run_dir, ckpt = run_dir_of(args), args.ckpt_path
    if _has_checkpoints(ckpt) and not _inside(ckpt, run_dir):
        raise UsageError(f"--overwrite_output_dir: --ckpt_path {ckpt} holds checkpoints of an earlier run "
                         "and lies outside the run directory: it is never emptied; remove them or choose another "
                         "--ckpt_path")
    records = [n for n in RECORDS if os.path.isfile(os.path.join(run_dir, n))]
    entries = checkpoint_entries(ckpt) if _inside(ckpt, run_dir) else []
    for name in records:
        os.remove(os.path.join(run_dir, name))
    for path in entries:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    _prune_role_folders(ckpt)
    removed = [f"{', '.join(records)} from {run_dir}"] if records else []
    if entries:
        removed.append(f"checkpoints {', '.join(os.path.relpath(e, ckpt) for e in entries)} from --ckpt_path {ckpt}")
    if removed:
        print(f"note: --overwrite_output_dir: removed the earlier run's {' and '.join(removed)}; nothing else there "
              "was touched", flush=True)


def _same_folder(a: str, b: str) -> bool:
    return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)


def _set_aside(args: argparse.Namespace) -> None:
    """--pretrain is --save_path: move the earlier run's records (and the checkpoints inside the run
    directory) to `<run dir>/earlier_runs/<its start time>/`."""
    run_dir, ckpt = run_dir_of(args), args.ckpt_path
    if _has_checkpoints(ckpt) and not _inside(ckpt, run_dir):
        way = "resume it with --load_checkpoint" if has_resumable(ckpt) else "remove them"
        raise UsageError(f"--ckpt_path {ckpt} holds checkpoints of an earlier run: {way} or choose another "
                         "--ckpt_path")
    moving = [os.path.join(run_dir, n) for n in RECORDS if os.path.isfile(os.path.join(run_dir, n))]
    entries = checkpoint_entries(ckpt) if _inside(ckpt, run_dir) else []
    if not (moving or entries):
        return
    first = os.path.join(run_dir, "run_config.json")
    started = os.path.getmtime(first) if os.path.isfile(first) else time.time()
    dest = os.path.join(run_dir, "earlier_runs", time.strftime("%Y%m%d-%H%M%S", time.localtime(started)))
    while os.path.exists(dest):
        dest += "+"
    os.makedirs(dest)
    for path in moving:
        os.replace(path, os.path.join(dest, os.path.basename(path)))
    names = [os.path.basename(p) for p in moving]
    if entries:  # one by one: --ckpt_path may be the run directory itself, next to the user's files
        ckpt_name = CHECKPOINTS if _same_folder(ckpt, run_dir) else os.path.relpath(ckpt, run_dir)
        for path in entries:
            target = os.path.join(dest, ckpt_name, os.path.relpath(path, ckpt))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(path, target)
        _prune_role_folders(ckpt)
        names.append(ckpt_name)
    print(f"note: --save_path {args.save_path} is --pretrain: this run trains from the model there and replaces "
          f"it; the earlier run's {', '.join(names)} moved to {dest}", flush=True)


def _nothing_to_resume(args: argparse.Namespace, held: list[str], run_flag: str) -> str:
    """The line refusing --load_checkpoint when --ckpt_path holds no checkpoint and the folders an earlier run."""
    return (f"--load_checkpoint: --ckpt_path {args.ckpt_path} holds no checkpoint to resume, and {run_flag} "
            f"{run_dir_of(args)} holds an earlier run ({'; '.join(held)}) that saved none (checkpoints are written "
            f"every --save_steps steps and when a run is stopped): start over with --overwrite_output_dir instead, "
            f"or choose another {run_flag}")


def check_earlier_run(args: argparse.Namespace) -> None:
    """Refuse, resume or start over an earlier run in the output folders (module docstring, step 3); refuse
    --load_checkpoint with nothing to resume where that would replace an earlier run."""
    overwrite, resume = getattr(args, "overwrite_output_dir", False), getattr(args, "load_checkpoint", False)
    if overwrite and resume:
        raise UsageError("--overwrite_output_dir starts the run over and --load_checkpoint resumes it: give one")
    held, resumable = earlier_run(args), has_resumable(args.ckpt_path)
    run_flag = "--run_dir" if getattr(args, "run_dir", None) else "--save_path"
    iterating = bool(getattr(args, "pretrain", None)) and _same_folder(args.pretrain, args.save_path)
    if resume and not resumable:
        if held and not iterating:
            raise UsageError(_nothing_to_resume(args, held, run_flag))
        print(f"note: --load_checkpoint: --ckpt_path {args.ckpt_path} holds no checkpoint to resume; this run starts "
              "from --pretrain", flush=True)
        resume = False
    if not held:
        return
    if overwrite:
        _start_over(args)
        return
    if not resume and iterating:
        _set_aside(args)
        return
    if not resume:
        ways = (["resume it with --load_checkpoint"] if resumable else []) + [
            "start over with --overwrite_output_dir", f"choose another {run_flag}"]
        nothing = "" if resumable else " and no checkpoint to resume"
        raise UsageError(f"{run_flag} {run_dir_of(args)} holds an earlier run ({'; '.join(held)}){nothing}: "
                         f"{', '.join(ways[:-1])}, or {ways[-1]}")
    if not (_logged_steps(run_dir_of(args)) or _has_model(args.save_path)):
        return  # the run directory's run_config.json, if any, is of an attempt that never trained
    saved = read_json_object(os.path.join(run_dir_of(args), "run_config.json"))
    check_same_run(run_settings(saved), run_settings(vars(args)),
                   allowed_changes(getattr(args, "allow_resume_changes", None)),
                   f"the run in {run_flag} {run_dir_of(args)}")


# ----------------------------------------------------------------------------- the claim


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

        folders, token = output_folders(self.args), uuid.uuid4().hex
        try:
            for flag, path in folders:  # before anything is made: a live run's folder is never touched
                refuse_if_shared(flag, path, token)
            for flag, path in folders:
                if check_writable(flag, path):
                    self.created.append(path)
            for flag, path in folders:
                lock = RunLock(flag, path)
                lock.acquire(this_command(), token)
                self.locks.append(lock)
            for flag, path in folders:  # again with the locks in place: a run that started meanwhile
                refuse_if_shared(flag, path, token)
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
