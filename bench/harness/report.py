"""The benches' JSON reports: writing one, and the versions of the packages a report records."""

from __future__ import annotations

import json
import os


def package_version(dist: str) -> str | None:
    """The installed version of distribution `dist` (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def write_report(path: str | None, res: dict) -> None:
    """A bench's JSON report at `path` (folders made as needed); nothing when `path` is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
