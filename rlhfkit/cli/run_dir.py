"""The wrapper of every trainer's `run()` (SFT family and RL alike): `training_run` holds the run's claim
on its folders (rlhfkit.runs.directory.RunDirectory: the lock, earlier runs, the default checkpoint
folder) and its stop handling (SIGINT / SIGTERM: rlhfkit.trainers.stop) while it runs.

    @training_run
    def run(args, ...): ...
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable, TypeVar

from rlhfkit.runs.directory import RunDirectory, _rank0
from rlhfkit.trainers import stop

F = TypeVar("F", bound=Callable[..., Any])


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
