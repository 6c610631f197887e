"""One-line notes about flags that have no effect in a run, logged once per process.

Flags that never have an effect in a command are declared `inert` in the flag table
(rlhfkit.config.flags) and noted when parsed. This is for the notes decided later, where the
reason is found (the device, the model, another flag): `note_once("note: --x has no effect: ...")`.
Rank 0 only under torchrun (RANK unset counts as rank 0).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
_NOTED: set[str] = set()


def note_once(line: str) -> None:
    """Print `line` once per process, on rank 0."""
    if line in _NOTED or os.environ.get("RANK", "0") != "0":
        return
    _NOTED.add(line)
    log.info(line)
