"""A disk that fills while torch.distributed.checkpoint writes (fault injection, no root or tmpfs needed):
the bytes that fit are written, then OSError(ENOSPC), as write(2) does on a full filesystem."""

from __future__ import annotations

import contextlib
import errno
import os

from torch.distributed.checkpoint.filesystem import FileSystem


class FillingStream:
    """A DCP output stream on a disk that fills after `budget` bytes: the bytes that fit are written,
    then OSError(ENOSPC), as a real write(2) does."""

    def __init__(self, stream, budget: int, error: OSError) -> None:
        self.stream, self.budget, self.error = stream, budget, error

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.budget:
            self.stream.write(data[:self.budget])
            self.budget = 0
            raise self.error
        self.budget -= len(data)
        return self.stream.write(data)

    def __getattr__(self, name):  # tell, fileno, flush, close: the real stream's
        return getattr(self.stream, name)


def fill_dcp_writes(monkeypatch, after: int = 20_000, error: OSError | None = None) -> None:
    """Every `.distcp` file torch.distributed.checkpoint writes from now on hits a full disk after `after` bytes."""
    real = FileSystem.create_stream
    error = error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield FillingStream(stream, after, error) if "w" in mode and str(path).endswith(".distcp") else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
