"""Hub ids for model flags (rlhfkit.models.hub): a local directory is used as given; `org/name` is
found in a Hugging Face cache laid out as huggingface_hub writes it; offline and not cached, or a
failed download, is one FileNotFoundError naming the flag, the id and the fix. The CLIs resolve all
model flags (comma lists too) in the parsing process (train_ppo_ray: the driver)."""

from __future__ import annotations

import os

import pytest
from hub_cache import place_in_hub_cache
from huggingface_hub import constants

from rlhfkit.rl_run.resolve import resolve
from rlhfkit.cli.common import resolve_model_paths
from rlhfkit.cli.train_ppo import build_parser as ppo_parser
from rlhfkit.models import hub
from rlhfkit.models.hub import ModelNotFoundError, looks_like_hub_id, resolve_model_path
from rlhfkit.models.loader import load_tokenizer
from rlhfkit.models.value import load_value_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = str(tmp_path / "hub")
    os.makedirs(d)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", d)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return d


def test_hub_id_shapes():
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "org/x.y_z-1"):
        assert looks_like_hub_id(name), name
    for name in ("./ckpt", "/abs/path", "~/m", "a/b/c", "a--b/c", "", "../m"):
        assert not looks_like_hub_id(name), name


def test_local_paths_are_kept(tiny_model_dir, tmp_path, cache, monkeypatch):
    assert resolve_model_path(tiny_model_dir) == tiny_model_dir
    missing = str(tmp_path / "nope")  # not shaped like a hub id: left to the directory check
    assert resolve_model_path(missing) == missing
    os.makedirs(tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)  # a relative directory that looks like a hub id is still the directory
    assert resolve_model_path("org/name") == "org/name"


def test_cached_hub_id_resolves_to_its_snapshot(tiny_model_dir, cache):
    snap = place_in_hub_cache(tiny_model_dir, cache, "org/tiny")
    assert resolve_model_path("org/tiny", "--pretrain") == snap
    assert os.path.islink(os.path.join(snap, "config.json"))
    tok = load_tokenizer("org/tiny")  # the loaders resolve too (Python callers may pass ids)
    assert tok.eos_token == "</s>"
    rm = load_value_model("org/tiny", init_value_head=True)
    assert rm.config.vocab_size == len(tok)


def test_offline_and_not_cached_names_flag_id_and_fix(tiny_model_dir, cache):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_path("org/missing", "--reward_pretrain")
    msg = str(e.value)
    assert msg.startswith("--reward_pretrain org/missing: ") and "\n" not in msg
    assert "HF_HUB_OFFLINE=1" in msg and "hf download org/missing" in msg and cache in msg
    # a snapshot holding config.json but no weights (e.g. only AutoConfig ran) is not a model
    place_in_hub_cache(tiny_model_dir, cache, "org/config-only", only=("config.json",))
    with pytest.raises(ModelNotFoundError, match="--pretrain org/config-only: no such local directory"):
        resolve_model_path("org/config-only", "--pretrain")


class _FakeHub:
    """snapshot_download online: records calls; raises `error` or 'downloads' `model_dir`."""

    def __init__(self, model_dir: str | None = None, error: Exception | None = None) -> None:
        self.model_dir, self.error, self.calls = model_dir, error, []

    def __call__(self, repo_id, local_files_only=False, **kw):
        from huggingface_hub.errors import LocalEntryNotFoundError

        self.calls.append((repo_id, local_files_only, kw))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        if self.error is not None:
            raise self.error
        return self.model_dir


def test_online_downloads_weights_and_configs_only(tiny_model_dir, cache, monkeypatch):
    import huggingface_hub

    fake = _FakeHub(tiny_model_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model_path("org/remote") == tiny_model_dir
    (_, cached_only, _), (_, online, kw) = fake.calls  # cache first, then one download (safetensors found)
    assert cached_only and not online
    assert "*.safetensors" in kw["allow_patterns"] and "*.bin" not in kw["allow_patterns"]


def test_online_failures_are_one_line(cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    not_found = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an HTTP response
    Exception.__init__(not_found, "404 Client Error")
    cases = [(not_found, "no model 'org/nope' on the Hugging Face hub"),
             (LocalEntryNotFoundError("connection refused\nmore"), "download failed (connection refused)")]
    for error, expected in cases:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", _FakeHub(error=error))
        with pytest.raises(ModelNotFoundError) as e:
            resolve_model_path("org/nope", "--critic_pretrain")
        assert str(e.value).startswith("--critic_pretrain org/nope: ") and expected in str(e.value)
        assert "\n" not in str(e.value)


def test_cli_resolves_every_model_flag_in_the_driver(tiny_model_dir, tmp_path, cache):
    """train_ppo / train_ppo_ray's driver: ids become snapshot folders before any actor starts;
    comma-separated reward models are resolved one by one."""
    snap = place_in_hub_cache(tiny_model_dir, cache, "org/policy")
    rm_snap = place_in_hub_cache(tiny_model_dir, cache, "org/rm")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1+1="}\n')
    parsed = ppo_parser().parse(["--pretrain", "org/policy", "--reward_pretrain", f"org/rm,{tiny_model_dir}",
                               "--critic_pretrain", "org/rm", "--prompt_data", str(prompts),
                               "--advantage_estimator", "gae", "--micro_train_batch_size", "1",
                               "--train_batch_size", "1", "--rollout_batch_size", "1", "--prompt_max_len", "16",
                               "--generate_max_len", "8"])
    args = resolve(parsed, world_size=1)
    assert args.pretrain == snap and args.critic_pretrain == rm_snap
    assert args.reward_pretrain == f"{rm_snap},{tiny_model_dir}"
    parsed.teacher_model = "org/missing"
    with pytest.raises(ModelNotFoundError, match="^--teacher_model org/missing: "):
        resolve_model_paths(parsed)


def test_hub_module_reads_offline_from_the_environment(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert not hub.is_offline()
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert hub.is_offline()


def _cli_cases(model: str, tmp: str) -> list[tuple[str, list[str], str]]:
    """(module, argv, the flag holding the uncached id) for every command that names models."""
    data, reward = f"{tmp}/d.jsonl", f"{tmp}/r.py"
    with open(reward, "w") as f:
        f.write("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    return [
        ("train_sft", ["--pretrain", "org/x", "--dataset", data], "--pretrain"),
        ("train_rm", ["--pretrain", "org/x", "--dataset", data], "--pretrain"),
        ("train_dpo", ["--pretrain", model, "--ref_pretrain", "org/x", "--dataset", data], "--ref_pretrain"),
        ("train_kto", ["--pretrain", "org/x", "--dataset", data], "--pretrain"),
        ("train_prm", ["--pretrain", "org/x", "--dataset", data, "--placeholder_token", "x"], "--pretrain"),
        ("train_kd", ["--pretrain", model, "--teacher_model", "org/x", "--dataset", data], "--teacher_model"),
        ("train_ppo", ["--pretrain", model, "--reward_pretrain", f"{model},org/x", "--prompt_data", data,
                       "--prompt_max_len", "8", "--generate_max_len", "8"], "--reward_pretrain"),
        ("train_ppo", ["--pretrain", model, "--remote_rm_url", reward, "--critic_pretrain", "org/x",
                       "--advantage_estimator", "gae", "--prompt_data", data, "--prompt_max_len", "8",
                       "--generate_max_len", "8"], "--critic_pretrain"),
        ("train_ppo_ray", ["--model.model_name_or_path", "org/x", "--remote_rm_url", reward, "--prompt_data", data],
         "--pretrain"),
        ("batch_inference", ["--eval_task", "rm", "--model_name_or_path", "org/x", "--dataset", data,
                             "--output_path", f"{tmp}/o.jsonl"], "--pretrain"),
        ("interactive_chat", ["--pretrain", "org/x"], "--pretrain"),
        ("serve_rm", ["--reward_pretrain", "org/x"], "--reward_pretrain"),
        ("lora_combiner", ["--model_path", "org/x", "--lora_path", tmp, "--output_path", f"{tmp}/o"], "--model_path"),
        ("lora_combiner", ["--model_path", model, "--lora_path", "org/x", "--output_path", f"{tmp}/o"], "--lora_path"),
    ]


def test_every_command_names_the_flag_of_an_uncached_id(tiny_model_dir, tmp_path, cache, capsys):
    """Offline and not cached: one line `prog: error: --flag org/x: ...`, exit 1, before any model loads."""
    import importlib

    for module, argv, flag in _cli_cases(tiny_model_dir, str(tmp_path)):
        main = importlib.import_module(f"rlhfkit.cli.{module}").main
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1, (module, err)
        assert err.startswith(f"{module}: error: {flag} org/x: no such local directory and not in the Hugging "
                              "Face cache") and len(err.splitlines()) == 1, (module, err)
