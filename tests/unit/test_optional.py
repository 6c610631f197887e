"""A missing optional package is one line naming the feature, the package and the pip command
(rlhfkit.optional), checked before a model loads; absence is simulated with `sys.modules[name] = None`
(what `import name` then raises is what a missing package raises). `train_ppo_ray --help` works
without ray (a fresh interpreter, so nothing imported ray before)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, subprocess_env

from rlhfkit.optional import MissingPackageError, is_installed, missing_message, require


def test_require_message_and_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingPackageError) as e:
        require("peft", "--lora_rank")
    assert str(e.value) == "--lora_rank needs the `peft` package, which is not installed: pip install 'rlhfkit[peft]'"
    assert isinstance(e.value, ImportError) and not is_installed("peft")
    assert missing_message("ray", "train_ppo_ray").endswith("`ray` package, which is not installed: "
                                                             "pip install 'rlhfkit[ray]'")
    assert missing_message("modelscope", "--use_ms").endswith("pip install 'modelscope'")  # no extra for it
    assert require("json", "x").dumps([1]) == "[1]"


def test_a_broken_dependency_is_not_reported_as_missing(monkeypatch):
    """peft installed but one of its own imports missing: that error, not "install peft"."""
    def broken(name, *a, **kw):
        raise ModuleNotFoundError("No module named 'some_dep'", name="some_dep")

    monkeypatch.setattr("importlib.import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="some_dep") as e:
        require("peft", "--lora_rank")
    assert not isinstance(e.value, MissingPackageError)


def test_library_call_sites(monkeypatch, tiny_model_dir, tmp_path):
    from rlhfkit.config.configs import ModelConfig
    from rlhfkit.models.loader import load_causal_lm, quantization_config
    from rlhfkit.trainers.metrics import MetricsLogger, WandbSettings

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingPackageError, match=r"^--lora_rank needs the `peft` package.*rlhfkit\[peft\]"):
        load_causal_lm(ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32", lora_rank=4))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(MissingPackageError, match=r"^--load_in_4bit needs the `bitsandbytes`.*rlhfkit\[qlora\]"):
        quantization_config(ModelConfig(load_in_4bit=True))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MissingPackageError, match=r"^--use_tensorboard needs .*rlhfkit\[tensorboard\]"):
        MetricsLogger(str(tmp_path / "a"), tensorboard_dir=str(tmp_path / "tb"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingPackageError, match=r"^--use_wandb needs .*rlhfkit\[wandb\]"):
        MetricsLogger(str(tmp_path / "b"), wandb=WandbSettings(key="1", project="p", org=None, group=None,
                                                               run_name=None))
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    from rlhfkit.rewards.http_client import _aiohttp

    with pytest.raises(MissingPackageError, match=r"aiohttp.*rlhfkit\[serve\]"):
        _aiohttp()


def _cli_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("blocked,flags,expected", [
    ("peft", ["--lora_rank", "4"], "--lora_rank needs the `peft` package, which is not installed: "
                                   "pip install 'rlhfkit[peft]'"),
    ("tensorboard", ["--use_tensorboard", "tb"], "--use_tensorboard needs the `tensorboard` package, which is "
                                                 "not installed: pip install 'rlhfkit[tensorboard]'"),
    ("wandb", ["--use_wandb", "1"], "--use_wandb needs the `wandb` package, which is not installed: "
                                    "pip install 'rlhfkit[wandb]'"),
    ("bitsandbytes", ["--load_in_4bit"], "--load_in_4bit needs the `bitsandbytes` package, which is not "
                                         "installed: pip install 'rlhfkit[qlora]'"),
])
def test_cli_one_line_before_loading(monkeypatch, capsys, tiny_model_dir, tmp_path, blocked, flags, expected):
    from rlhfkit.cli import train_sft

    monkeypatch.setitem(sys.modules, blocked, None)
    loaded = []
    monkeypatch.setattr("rlhfkit.models.given.load_tokenizer", lambda *a, **k: loaded.append(1))
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1+1=", "output": "2"}\n')
    err = _cli_error(capsys, train_sft.main, ["--pretrain", tiny_model_dir, "--dataset", str(data),
                                              "--save_path", str(tmp_path / "o"), *flags])
    assert err == f"train_sft: error: {expected}" and not loaded


def test_lora_combiner_without_peft(monkeypatch, capsys, tiny_model_dir, tmp_path):
    from rlhfkit.cli.lora_combiner import main

    monkeypatch.setitem(sys.modules, "peft", None)
    err = _cli_error(capsys, main, ["--model_path", tiny_model_dir, "--lora_path", str(tmp_path),
                                    "--output_path", str(tmp_path / "o")])
    assert err == "lora_combiner: error: lora_combiner needs the `peft` package, which is not installed: " \
                  "pip install 'rlhfkit[peft]'"


def test_backend_deepspeed_is_refused(capsys, tiny_model_dir, tmp_path):
    from rlhfkit.cli import train_sft

    err = _cli_error(capsys, train_sft.main, ["--pretrain", tiny_model_dir, "--dataset", str(tmp_path / "d.jsonl"),
                                              "--backend", "deepspeed"])
    assert err == "train_sft: error: --backend deepspeed is not available yet; use --backend fsdp2"


BLOCK_AND_RUN = """
import runpy, sys
sys.modules[sys.argv[1]] = None
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def test_train_ppo_ray_without_ray(tmp_path):
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", BLOCK_AND_RUN, "ray", "rlhfkit.cli.train_ppo_ray", *argv],
                              env=subprocess_env(), capture_output=True, text=True, timeout=120)

    r = run("--help")
    assert r.returncode == 0 and "--ray_address" in r.stdout, r.stderr[-2000:]
    r = run("--pretrain", str(tmp_path), "--prompt_data", "p.jsonl")
    assert r.returncode == 1 and r.stderr.strip() == ("train_ppo_ray: error: train_ppo_ray needs the `ray` package, "
                                                      "which is not installed: pip install 'rlhfkit[ray]'"), r.stderr


def test_no_deepspeed_extra_and_the_new_extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(f"{ROOT}/pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert "deepspeed" not in extras and extras["tensorboard"] == ["tensorboard"] and extras["wandb"] == ["wandb"]
    assert any(p.startswith("bitsandbytes") for p in extras["qlora"])
    from rlhfkit.optional import PACKAGES

    for module, (_, extra) in PACKAGES.items():
        assert extra is None or extra in extras, (module, extra)
