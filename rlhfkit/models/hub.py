"""Model names -> local directories: a directory as given, or a Hugging Face hub id resolved through
the hub cache (a leaf module: no other rlhfkit import).

    resolve_model_path("/data/my-sft", "--pretrain")     -> "/data/my-sft"
    resolve_model_path("Qwen/Qwen2.5-0.5B", "--pretrain")
        -> "$HF_HUB_CACHE/models--Qwen--Qwen2.5-0.5B/snapshots/<commit>"

Order for a name that is not an existing path and is shaped like a hub id (`name` or `org/name`):

1. the Hugging Face cache (HF_HOME / HF_HUB_CACHE), without any network call: the snapshot that
   `refs/main` points to, used when it holds config.json (adapter_config.json for an adapter) and
   weight files;
2. when not cached and HF_HUB_OFFLINE is not set: `snapshot_download` with only what transformers
   loads (configs, tokenizer files, safetensors weights; `.bin` weights only when the repository has
   no safetensors), into the same cache;
3. otherwise `ModelNotFoundError` (a FileNotFoundError, so the CLIs print it as one line) naming
   the flag, the id and the fix (`hf download ID` where there is network, or a local directory).

The CLIs resolve every model flag once, early (`rlhfkit.cli.common.resolve_model_paths`), so torchrun
ranks and Ray actors (resolved in the driver) get local paths; the loaders resolve again (a no-op for a
directory), so Python callers may pass hub ids too.
"""

from __future__ import annotations

import glob
import os

MODEL_FILE, ADAPTER_FILE = "config.json", "adapter_config.json"
# what transformers reads from a model repository (weights in safetensors; .bin only as a fallback);
# no *.py: remote code is never trusted
_ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
_IGNORE = ["original/*", "onnx/*", "openvino/*", "*.onnx", "*.gguf", "*.h5", "*.msgpack", "*.ot"]
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


class ModelNotFoundError(FileNotFoundError):
    """A model flag names neither a local directory nor a hub model we can get; the message says
    which flag, which name, and what to do."""


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, now or when huggingface_hub was imported."""
    from huggingface_hub import constants

    env = any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
              for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return env or bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def looks_like_hub_id(name: str) -> bool:
    """`name` or `org/name` as the hub allows them (no leading '.', '/' or '~', no '--' or '..')."""
    if not name or name[0] in "./~" or os.sep in name.replace("/", "") or name.count("/") > 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _complete(folder: str, required: str) -> bool:
    """The snapshot holds the required config and, for a model, weight files."""
    if not os.path.isfile(os.path.join(folder, required)):
        return False
    return any(glob.glob(os.path.join(folder, pattern)) for pattern in _WEIGHTS)


def cached_snapshot(repo_id: str, required: str = MODEL_FILE) -> str | None:
    """The cached snapshot folder of `repo_id` (refs/main), or None when not cached or incomplete."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, IncompleteSnapshotError, FileNotFoundError):
        return None
    return folder if _complete(folder, required) else None


def _download(repo_id: str, flag: str, required: str) -> str:
    """`repo_id` from the hub into the cache (safetensors weights, else .bin); errors name `flag`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{flag} {repo_id}"
    try:
        folder = snapshot_download(repo_id, allow_patterns=_ALLOW, ignore_patterns=_IGNORE)
        if not glob.glob(os.path.join(folder, "*.safetensors")):
            folder = snapshot_download(repo_id, allow_patterns=["*.bin", *_ALLOW], ignore_patterns=_IGNORE)
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{where}: a gated model on the Hugging Face hub; accept its terms on huggingface.co/{repo_id} "
            "and log in (`hf auth login` or HF_TOKEN), or pass a local model directory") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{where}: no such local directory, and no model {repo_id!r} on the Hugging Face hub (a private "
            "model needs `hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{where}: the hub repository has no 'main' revision") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        reason = str(e).strip().splitlines()[0].removeprefix("Got: ") if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(
            f"{where}: no such local directory, not in the Hugging Face cache ({hub_cache_dir()}), and the "
            f"download failed ({reason}); run `hf download {repo_id}` where there is network, or pass a "
            "local model directory") from None
    if not os.path.isfile(os.path.join(folder, required)):
        raise ModelNotFoundError(f"{where}: the hub repository has no {required} (not a Hugging Face "
                                 f"{'adapter' if required == ADAPTER_FILE else 'model'})")
    return folder


def resolve_model_path(name: str, flag: str = "--pretrain", required: str = MODEL_FILE) -> str:
    """A local directory for `name` (module docstring); `required` is the file a download must have
    (config.json; adapter_config.json for a LoRA adapter). Names that are neither an existing path nor
    shaped like a hub id are returned unchanged (the caller reports the missing directory)."""
    if os.path.exists(name) or not looks_like_hub_id(name):
        return name
    folder = cached_snapshot(name, required)
    if folder is not None:
        return folder
    if is_offline():
        raise ModelNotFoundError(
            f"{flag} {name}: no such local directory and not in the Hugging Face cache ({hub_cache_dir()}), "
            f"and HF_HUB_OFFLINE=1 forbids downloading; run `hf download {name}` where there is network "
            "(or unset HF_HUB_OFFLINE), or pass a local model directory")
    return _download(name, flag, required)
