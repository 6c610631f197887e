"""`import_user_file`: a user's `.py` file (reward_func, agent) imported as a fresh module, errors
naming the flag and the file (a leaf module: the reward and agent loaders both use it).

A file that fails to import raises `UserFileError`: one line naming the flag, the file and the
exception, then the user's own frames (those in the file's folder), as the CLIs print it:

    train_ppo: error: --remote_rm_url /data/reward.py: importing the file failed: NameError: name 'np' is not defined
      File "/data/reward.py", line 4, in <module>
        SCALE = np.float32(2)
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import traceback
from types import ModuleType


class UserFileError(ImportError):
    """A user's file that does not import; the message names the flag, the file and its frames."""


def user_frames(exc: BaseException, folder: str) -> str:
    """The traceback lines of `exc` in files under `folder` (a SyntaxError: its line and caret)."""
    if isinstance(exc, SyntaxError):
        lines = traceback.format_exception_only(type(exc), exc)[:-1]  # the last line is the message itself
        return "".join(lines).rstrip("\n")
    folder = os.path.abspath(folder) + os.sep
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename).startswith(folder)]
    return "".join(traceback.format_list(mine)).rstrip("\n")


def _failed(flag: str, path: str, message: str, exc: BaseException) -> UserFileError:
    frames = user_frames(exc, os.path.dirname(path))
    return UserFileError(f"{flag} {path}: {message}" + (f"\n{frames}" if frames else ""))


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
        raise _failed(flag, path, f"{e}{hint}", e) from e
    except Exception as e:
        del sys.modules[name]
        raise _failed(flag, path, f"importing the file failed: {type(e).__name__}: {e}", e) from e
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module
