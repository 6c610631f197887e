"""Optional packages: import one where a feature needs it, or fail with one line naming the feature,
the package and the pip command (imports nothing of rlhfkit).

    peft = require("peft", "--lora_rank")
    -> MissingPackageError: --lora_rank needs the `peft` package, which is not installed:
       pip install 'rlhfkit[peft]'

`MissingPackageError` is an ImportError (callers that already catch ImportError keep working); the
CLIs print it as one line and exit 1 (`rlhfkit.cli.common.cli_main`). A package that is installed
but fails to import for another reason (a broken dependency inside it) raises its own error.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# import name -> (distribution on PyPI, rlhfkit extra that installs it, or None)
PACKAGES: dict[str, tuple[str, str | None]] = {
    "peft": ("peft", "peft"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "ray": ("ray[default]", "ray"),
    "bitsandbytes": ("bitsandbytes", "qlora"),
    "openai": ("openai", "openai"),
    "aiohttp": ("aiohttp", "openai"),
    "fastapi": ("fastapi", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "datasets": ("datasets", "datasets"),
    "vllm": ("vllm", "vllm"),
    "math_verify": ("math-verify", "math"),
    "gguf": ("gguf", "gguf"),
    "modelscope": ("modelscope", None),
    "flash_attn": ("flash-attn", None),
}


class MissingPackageError(ImportError):
    """An optional package a requested feature needs is not installed (the message has the fix)."""


def pip_command(module: str, extra: str | None = None) -> str:
    """`pip install 'rlhfkit[extra]'` (the package's extra unless `extra` is given), or the package."""
    dist, default_extra = PACKAGES.get(module, (module, None))
    extra = extra or default_extra
    return f"pip install 'rlhfkit[{extra}]'" if extra else f"pip install '{dist}'"


def missing_message(module: str, feature: str, extra: str | None = None) -> str:
    dist = PACKAGES.get(module, (module, None))[0].split("[")[0]
    return f"{feature} needs the `{dist}` package, which is not installed: {pip_command(module, extra)}"


def is_installed(module: str) -> bool:
    """Whether `module` can be imported (found on the path; not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a None entry in sys.modules
        return False


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """Import `module` for `feature` (a flag or command, e.g. "--use_tensorboard"), or raise
    MissingPackageError with the pip command (`extra` overrides the package's rlhfkit extra)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != top:
            raise  # installed, but something it imports is missing: its own message says what
        raise MissingPackageError(missing_message(top, feature, extra)) from None
