"""What a failed checkpoint save or load raises, and how the failures of torch.distributed.checkpoint (a
BaseException wrapping each rank's failure) are told from a kill and named in one line."""

from __future__ import annotations

import sys


class CheckpointError(ValueError):
    """A checkpoint that does not save or load (damaged, or not of this model); the message names it,
    `reason` says what failed in a few words (for the line that skips a damaged checkpoint)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class CheckpointSaveError(CheckpointError):
    """A save that failed for a reason other than a full disk (its partial files removed); `root` is
    the folder of the checkpoints (--ckpt_path)."""

    def __init__(self, message: str, root: str) -> None:
        super().__init__(message)
        self.root = root


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint without checksums (written before they were recorded) that does not read: damaged,
    as far as anyone can tell; a caller choosing among several skips it for an older one."""


def is_failure(e: BaseException) -> bool:
    """Whether `e` is a failure of a save or load itself: any Exception, or torch.distributed.checkpoint's
    CheckpointException, which derives from BaseException; not a kill (KeyboardInterrupt, SystemExit,
    a stop signal's RunStopped), which must go through untouched."""
    if isinstance(e, Exception):
        return True
    api = sys.modules.get("torch.distributed.checkpoint.api")  # imported if DCP ran (importing it costs 2 s)
    return api is not None and isinstance(e, api.CheckpointException)


def root_causes(e: BaseException) -> list[BaseException]:
    """The exceptions a CheckpointException wraps (one per failed rank), or [e]."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    if api is not None and isinstance(e, api.CheckpointException) and e.failures:
        return [exc for exc, _ in e.failures.values()]
    return [e]


def one_line(e: BaseException, limit: int = 240) -> str:
    """`Type: first line of the message` of the first root cause of `e` (cut at `limit` characters)."""
    cause = root_causes(e)[0]
    text = str(cause).strip().splitlines()
    line = f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."
