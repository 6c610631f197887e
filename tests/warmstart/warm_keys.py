"""What a warm interpreter may serve: the command lines it runs and the environment it was imported under.

Both sides import this module: the client (`client.py`, started for every `python` the tests run) to
decide whether to ask a warm interpreter at all, and the server (`server.py`) to name itself. It
imports nothing beyond the standard library's smallest modules, so the client stays fast.

An interpreter that imported torch and transformers once can stand in for a fresh one only where
the fresh one would have imported the same things the same way. Two things decide that:

- The command line. `[-u|-B]... (-m MODULE | SCRIPT) ARGS...`: the forms CPython runs the same way
  after a fork (`parse_command`). Any other option (-E, -I, -S, -O, -W, -X, -c ...) is run by the real
  interpreter, and so are the scripts of Ray's own daemons (`DAEMON_SCRIPTS`), which watch their parent,
  and its client server (`DAEMON_MODULES`).
- The environment that modules read while they are imported (`IMPORT_ENV_PREFIXES`: Python's own
  variables, locale, the torch / Hugging Face / numerics / Ray-free library settings, library paths).
  A warm interpreter is keyed by those variables (`env_key`); a process whose variables differ gets
  another one, or the real interpreter. Everything else (RANK, MASTER_PORT, RAY_ADDRESS, a script's
  MODEL or OUT) is read at run time and passed to the child as it is.
"""

from __future__ import annotations

import hashlib
import os

# variables read at import time by Python itself or by a module the server imports ahead
IMPORT_ENV_PREFIXES = (
    "PYTHON", "LANG", "LC_", "TZ", "HOME", "XDG_", "TMPDIR", "TEMP", "TMP", "LD_", "MALLOC_", "GLIBC_",
    "TORCH_", "TORCHINDUCTOR", "TORCHDYNAMO", "PYTORCH_", "CUDA_", "NVIDIA_", "TRITON_",
    "HF_", "HUGGINGFACE", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_", "USE_TORCH", "USE_TF", "USE_FLAX", "USE_JAX",
    "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "NPY_", "NUMEXPR_", "NUMBA_", "MPL", "DISPLAY",
    "AIOHTTP_", "PROTOCOL_BUFFERS_", "GRPC_", "SSL_CERT", "RLHFKIT_",
)
# read at run time only, though their prefixes say otherwise (torchrun sets them per rank; torch sets its
# compile cache folder while importing, so every child of a torch process has it; this tool's own)
RUNTIME_ENV_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "RLHFKIT_WARM_", "TORCHINDUCTOR_CACHE_DIR",
                        "PYTHONBREAKPOINT")  # read by breakpoint() when called (Ray sets it for its workers)

# Ray's daemons check that their parent is the process that started them: never forked from here
DAEMON_SCRIPTS = ("/ray/dashboard/", "/ray/_private/log_monitor.py", "/ray/autoscaler/",
                  "/ray/_private/runtime_env/agent/")
# Ray's client server: one a head, in an environment of its own (Ray's allocator preloaded): a warm
# interpreter started for it (about 10 CPU-seconds of imports) would never serve another process
DAEMON_MODULES = ("ray.util.client.server",)
RAY_WORKER = "/ray/_private/workers/default_worker.py"


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` that a module may read while it is imported."""
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_ENV_PREFIXES) and not k.startswith(RUNTIME_ENV_PREFIXES)}


def env_key(env: dict[str, str], python: str) -> str:
    """A short name for a warm interpreter: the real interpreter and the import-time variables."""
    items = sorted(import_env(env).items())
    h = hashlib.sha256(repr((python, items)).encode()).hexdigest()
    return h[:16]


def parse_command(args: list[str]) -> tuple[list[str], str, str, list[str]] | None:
    """(options, kind, target, rest) of a `python` command line, kind "module" or "script", or None when a
    warm interpreter cannot run it the way a fresh one would."""
    opts: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-", "-m"):
        if args[i] not in ("-u", "-B"):
            return None
        opts.append(args[i])
        i += 1
    if i >= len(args):
        return None  # an interactive interpreter, or `python -` reading stdin
    if args[i] == "-m":
        if i + 1 >= len(args) or args[i + 1].startswith("-"):
            return None
        return opts, "module", args[i + 1], args[i + 2:]
    script = args[i]
    if script == "-" or not script.endswith(".py") and not _is_console_script(script):
        return None
    if any(d in os.path.abspath(script) for d in DAEMON_SCRIPTS) or any(m in args[i + 1:] for m in DAEMON_MODULES):
        return None
    return opts, "script", script, args[i + 1:]


def _is_console_script(path: str) -> bool:
    """A pip-made launcher (`#!.../python` then `from pkg import main`), such as bin/rlhfkit or bin/torchrun."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0] and b"import" in head
