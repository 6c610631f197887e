"""Shared fixtures: offline tiny models (nothing is downloaded); the processes the tests start run on
warm interpreters (tests/warmstart: torch and transformers imported once per run, not once per process)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import warmstart

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# what the runs set for themselves (rlhfkit.logs.quiet_third_party; one thread a process, as this one uses):
# set from the start, the environment a module sees while importing is the same in every process of the run
for _var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# inductor builds its kernels in this process rather than in a pool of fresh interpreters, each importing torch
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Ray started by a test keeps no idle workers (a warm one starts in a fraction of a second) and collects no
# metrics: an idle local Ray then costs half the CPU it would. Its log monitor looks for new log files
# every 0.5 s instead of on every 0.1 s pass (a glob over every worker's log files, the largest cost of a
# Ray head that lives through many runs); a worker's output still reaches the driver.
for _var, _value in (("RAY_enable_worker_prestart", "0"), ("RAY_num_workers_soft_limit", "0"),
                     ("RAY_enable_metrics_collection", "0"), ("RAY_USAGE_STATS_ENABLED", "0"),
                     ("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")):
    os.environ.setdefault(_var, _value)
torch.set_num_threads(1)

_WARM_DIR: str | None = None


def pytest_configure(config):
    """Warm interpreters for this run: the controller (the process that is not an xdist worker) starts the
    first ones while the workers start: for the environment helpers.subprocess_env gives the CLI runs, and
    for this process's own (the workers of a Ray started in-process)."""
    global _WARM_DIR
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    owner = os.getppid() if worker else os.getpid()
    from helpers import subprocess_env

    _WARM_DIR = warmstart.configure(is_controller=not worker, owner=owner,
                                    prewarm_envs=[subprocess_env(), dict(os.environ)])


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        warmstart.unconfigure(_WARM_DIR)


def _import_env() -> dict[str, str]:
    """The variables of os.environ that modules read while they are imported: what names a warm interpreter."""
    return warmstart.tool("warm_keys").import_env(dict(os.environ))


def _restore_import_env(before: dict[str, str]) -> None:
    now = _import_env()
    for k in now.keys() - before.keys():
        del os.environ[k]
    for k, v in before.items():
        if now.get(k) != v:
            os.environ[k] = v


@pytest.fixture(autouse=True, scope="module")
def _import_env_kept_by_module():
    """The import-time variables a module's tests and fixtures set end with the module (a test of the benches
    imports a bench module, which sets HF_DATASETS_OFFLINE and HF_HUB_DISABLE_TELEMETRY; an in-process run with
    --full_determinism sets CUDA_LAUNCH_BLOCKING): otherwise every process a later test of this worker starts has
    another import environment, so another warm interpreter (tests/warmstart: seconds of imports, and cold
    interpreters until it serves). What session fixtures set stays."""
    before = _import_env()
    yield
    _restore_import_env(before)


@pytest.fixture(autouse=True)
def _import_env_kept():
    """The same for each test: the import-time variables it sets end with it, and so does a run log a run it made
    in this process left open (a later test's log records would otherwise go to a file in a folder removed since)."""
    before = _import_env()
    yield
    _restore_import_env(before)
    logs = sys.modules.get("rlhfkit.logs")
    if logs is not None:
        logs.close_run_logs()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer, hidden-64 Llama with the character tokenizer (about 145k parameters)."""
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_llama"))
    return make_tiny_model(path, TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, max_position_embeddings=256))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """A 2-layer Qwen2 (grouped-query attention: 4 heads, 2 kv heads)."""
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    return make_tiny_model(path, TinyModelSpec(arch="qwen2", hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=256))


@pytest.fixture(scope="session")
def tiny_long_model_dir(tmp_path_factory) -> str:
    """The tiny Llama with 8192 positions, for seed commands whose --max_len is 4096 or 8192
    (a --max_len beyond the model's positions is an error)."""
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_llama_8k"))
    return make_tiny_model(path, TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, max_position_embeddings=8192))


def _tiny_vlm(tmp_path_factory, arch: str) -> str:
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
    return make_tiny_model(path, TinyModelSpec(arch=arch, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, max_position_embeddings=512))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> str:
    """A 2-layer Qwen2.5-VL (4 heads, 2 kv heads, q/k/v biases) with a 2-block vision tower and its image
    processor (28-pixel merged patches)."""
    return _tiny_vlm(tmp_path_factory, "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory) -> str:
    """A 2-layer Qwen3-VL (q/k norms, interleaved M-RoPE, one deepstack layer; 32-pixel merged patches)."""
    return _tiny_vlm(tmp_path_factory, "qwen3_vl")


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory) -> str:
    """`make_data shapes` pictures and rows (64 train, 32 prompts, 32 held out, 16 pairs)."""
    from rlhfkit.cli import make_data

    path = str(tmp_path_factory.mktemp("shapes"))
    make_data.main(["shapes", "--out", path, "--num_train", "64", "--num_prompts", "32", "--num_eval", "32",
                    "--num_pairs", "16"])
    return path


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` sends the tests of one xdist_group to one worker by a "@group" suffix of their node ids.
    pytest-xdist 3.8 sets it through item._nodeid, which pytest 9 no longer reads (the id lives in item._id), so
    there the groups were silently ignored; add the suffix here where xdist's did not take.

    The tests marked slow (and with them their groups) are handed out first, the longest work first, so no
    100-second test starts when the other workers are nearly done (`make test` passes --no-loadscope-reorder,
    which keeps this order instead of sorting the groups by their number of tests)."""
    if not getattr(config.option, "loadgroup", False):
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names or item.nodeid.endswith("@" + "_".join(names)):
            continue
        if not hasattr(item, "_id"):  # a pytest where xdist's own suffix works
            continue
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
