"""The type checker proves the framework's seams: collaborators typed by protocols, fakes that satisfy them.

mypy runs as pyproject.toml's [tool.mypy] configures it (the packages it checks are its `files`) and
must report no error; the failure lists them. Its cache is the default `.mypy_cache` in the
repository, so a run after the first reads only the files that changed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (the dev extra has it)")
def test_mypy_finds_no_error():
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert proc.returncode == 0 and not errors, (
        f"mypy (exit {proc.returncode}) found {len(errors)} error(s):\n" + "\n".join(errors)
        + ("" if errors else f"\n{proc.stdout}{proc.stderr}"))
