"""`import_user_file`: a user's `.py` file (reward_func, agent) imported as a fresh module, errors
naming the flag and the file (a leaf module: the reward and agent loaders both use it)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from types import ModuleType


def import_user_file(path: str, flag: str) -> ModuleType:
    """Import a user's ``.py`` file as a fresh module; errors name the flag and the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    if not path.endswith(".py"):
        raise ValueError(f"{flag} {path}: expected a .py file")
    path = os.path.abspath(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"rlhfkit_user_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)  # sibling helper modules of the user file can be imported
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        del sys.modules[name]
        hint = ""
        if (e.name or "").startswith("openrlhf"):
            hint = (" -- replace `from openrlhf.utils.agent import ...` with `from rlhfkit.agents import ...` "
                    "(or `rlhfkit.utils.agent`), and `from openrlhf.utils import ...` with "
                    "`from rlhfkit.utils import ...`")
        raise ImportError(f"{flag} {path}: {e}{hint}") from e
    except Exception as e:
        del sys.modules[name]
        raise ImportError(f"{flag} {path}: importing the file failed: {type(e).__name__}: {e}") from e
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module
