"""A `--remote_rm_url` reward_func file: `path.py` or `path.py:name` (`is_reward_file`, `split_reward_file`),
imported once per run and its function checked to be in one of the two shapes of shapes.py
(`load_reward_func`)."""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from rlhfkit.rewards.shapes import SHAPES, reward_shape
from rlhfkit.usercode.files import import_user_file

FLAG = "--remote_rm_url"

_FUNC_SPEC = re.compile(r"^(.*\.py):([A-Za-z_][A-Za-z0-9_]*)$")


def is_reward_file(spec: str) -> bool:
    """A reward_func .py file, alone or with a function name (``reward.py:accuracy``)."""
    return spec.endswith(".py") or _FUNC_SPEC.match(spec) is not None


def split_reward_file(spec: str) -> tuple[str, str]:
    """``reward.py`` -> (reward.py, "reward_func"); ``reward.py:accuracy`` -> (reward.py, "accuracy")."""
    m = _FUNC_SPEC.match(spec)
    return (m.group(1), m.group(2)) if m else (spec, "reward_func")


_loaded: dict[tuple[str, str, int], Callable[..., Any]] = {}  # (path, name, mtime): the file imported once


def load_reward_func(spec: str) -> Callable[..., Any]:
    """Import the file of ``spec`` (``path.py`` or ``path.py:name``) and return its ``reward_func`` (or
    `name`), checked to be in one of the two shapes of ``shapes.py``. A file is imported once per run
    (the check when the trainer is built and the reward source read the same module)."""
    path, name = split_reward_file(spec)
    key = (os.path.abspath(path), name, os.stat(path).st_mtime_ns) if os.path.isfile(path) else None
    if key in _loaded:
        return _loaded[key]
    module = import_user_file(path, FLAG)
    fn = getattr(module, name, None)
    if not callable(fn):
        other = "" if name != "reward_func" else f" (or name another function: {FLAG} {path}:NAME)"
        raise AttributeError(f"{FLAG} {path} must define {name}: {SHAPES}{other}")
    try:
        reward_shape(fn, f"{FLAG} {spec}")
    except TypeError as e:
        raise TypeError(str(e)) from None
    _loaded[key] = fn
    return fn
