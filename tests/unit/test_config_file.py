"""`--config FILE`: YAML / JSON flag values (flat, dotted, nested, with or without --), command-line
flags override the file, bad keys and values are one error naming key and file, and a run's
run_config.json replays the run's namespace (train_ppo: after its derived defaults are filled)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import pytest

from rlhfkit.cli import lora_combiner, train_ppo, train_sft

from rlhfkit.rl_run.resolve import resolve
from rlhfkit.config.flags import write_resolved_config

yaml = pytest.importorskip("yaml")


def write(tmp_path, name, data) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data, sort_keys=False))
    return str(path)


def refused(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_yaml_nested_dotted_flat_and_switches(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("pretrain: ./policy\n"
                    "actor:\n  adam:\n    lr: 2.0e-6\n"        # nested mapping == --actor.adam.lr
                    "rollout.n_samples_per_prompt: 4\n"        # dotted
                    "--temperature: 0.7\n"                     # with the leading --
                    "eps_clip_low_high: [0.2, 0.28]\n"         # two values
                    "flash_attn: true\n"                       # a constant switch
                    "use_kl_loss: true\n"
                    "init_kl_coef: 1e-3\n")                    # YAML reads 1e-3 as a string: converted
    ns = train_ppo.build_parser().parse(["--config", str(path)])
    assert ns.pretrain == "./policy" and ns.actor_learning_rate == 2e-6 and ns.n_samples_per_prompt == 4
    assert ns.temperature == 0.7 and ns.eps_clip_low_high == [0.2, 0.28]
    assert ns.attn_implementation == "flash_attention_2" and ns.use_kl_loss is True and ns.init_kl_coef == 1e-3
    assert ns.top_p == 1.0  # untouched: the default


def test_command_line_overrides_the_file(tmp_path):
    path = write(tmp_path, "run.yaml", {"learning_rate": 1e-4, "param_dtype": "fp32", "max_len": 64,
                                        "gradient_checkpointing": True})
    p = train_sft.build_parser()
    ns = p.parse(["--config", path, "--learning_rate", "3e-4", "--bf16"])
    assert ns.learning_rate == 3e-4 and ns.param_dtype == "bf16"  # the command line wins, no conflict
    assert ns.max_len == 64 and ns.gradient_checkpointing is True  # from the file
    assert p.get_default("learning_rate") == 5e-6  # the parser's own defaults are back afterwards
    assert p.parse([]).max_len == 2048


def test_json_keys_with_dashes_and_false_switches(tmp_path):
    path = write(tmp_path, "run.json", {"--data.max_len": 128, "muon_nesterov": False, "bf16": False,
                                        "target_modules": "q_proj"})
    ns = train_sft.build_parser().parse(["--config", path])
    assert ns.max_len == 128 and ns.muon_nesterov is False
    assert ns.param_dtype == "bf16"  # bf16: false leaves the switch out (the default stays)
    assert ns.target_modules == ["q_proj"]


def test_unknown_key_names_key_and_file(tmp_path, capsys):
    path = write(tmp_path, "run.yaml", {"learning_rate": 1e-4, "lerning_rate": 1e-4})
    line = refused(train_sft.build_parser(), ["--config", path], capsys)
    assert line == (f"train_sft: error: --config {path}: key 'lerning_rate' is not a flag of train_sft "
                    "(did you mean 'learning_rate'?)")


def test_nested_unknown_key_is_named_dotted(tmp_path, capsys):
    path = write(tmp_path, "run.yaml", {"actor": {"adam": {"lrr": 1e-6}}})
    assert "key 'actor.adam.lrr' is not a flag of train_ppo" in refused(train_ppo.build_parser(),
                                                                       ["--config", path], capsys)


@pytest.mark.parametrize("data, message", [
    ({"max_len": "long"}, "key 'max_len': expected an integer, got 'long'"),
    ({"max_len": 2.5}, "key 'max_len': expected an integer, got 2.5"),
    ({"learning_rate": True}, "key 'learning_rate': expected a number, got True"),
    ({"param_dtype": "fp8"}, "key 'param_dtype': 'fp8' is not one of bf16, fp16, fp32"),
    ({"adam_betas": [0.9]}, "key 'adam_betas': expected a list of 2 values, got [0.9]"),
    ({"gradient_checkpointing": "yes"}, "key 'gradient_checkpointing': expected true or false, got 'yes'"),
    ({"pretrain": "a", "model.model_name_or_path": "b"},
     "keys 'pretrain' and 'model.model_name_or_path' conflict: both set --pretrain; keep one of them"),
])
def test_bad_values_are_named(tmp_path, capsys, data, message):
    path = write(tmp_path, "run.yaml", data)
    line = refused(train_sft.build_parser(), ["--config", path], capsys)
    assert line.startswith(f"train_sft: error: --config {path}: ") and line.endswith(message), line


def test_missing_or_malformed_file(tmp_path, capsys):
    line = refused(train_sft.build_parser(), ["--config", str(tmp_path / "nope.yaml")], capsys)
    assert line.endswith("nope.yaml: no such file")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not valid JSON" in refused(train_sft.build_parser(), ["--config", str(bad)], capsys)
    lst = write(tmp_path, "list.yaml", [1, 2])
    assert "expected a mapping of flag names to values, got list" in refused(train_sft.build_parser(),
                                                                              ["--config", lst], capsys)


def test_file_satisfies_required_flags(tmp_path):
    path = write(tmp_path, "merge.yaml", {"model_path": "m", "lora_path": "l", "output_path": "o"})
    p = lora_combiner.build_parser()
    assert p.parse(["--config", path]).lora_path == "l"
    with pytest.raises(SystemExit):
        p.parse([])  # still required without the file


def test_inert_flag_from_a_file_prints_its_note(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    path = write(tmp_path, "run.yaml", {"zpg": 4})
    train_sft.build_parser().parse(["--config", path])
    assert "note: --zpg has no effect" in capsys.readouterr().out


def test_run_config_replays_the_rl_namespace(tmp_path, monkeypatch):
    """train_ppo fills derived defaults (--generate_max_len from --max_len, --ema_beta, the critic's
    optimizer flags, --clip_eps_low into --eps_clip_low_high): the replayed parse equals the original
    parse, and resolving it gives the same config."""
    monkeypatch.setenv("RANK", "1")  # no notes
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))  # --use_wandb checks the package is there
    monkeypatch.chdir(tmp_path)
    os.mkdir("p")  # --pretrain p: a local directory
    with open("r.py", "w") as f:  # the reward file, which resolving the flags reads
        f.write("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    argv = ["--pretrain", "p", "--prompt_data", "d.jsonl", "--remote_rm_url", "r.py", "--advantage_estimator",
            "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8",
            "--max_len", "64", "--clip_eps_low", "0.1", "--use_icepop", "--adam_betas", "0.8", "0.9",
            "--use_wandb", "secret-key"]
    p = train_ppo.build_parser()
    parsed = p.parse(argv)
    first = {k: v for k, v in vars(parsed).items() if k != "config"}
    flags = resolve(parsed, 1)
    assert {k: v for k, v in vars(parsed).items() if k != "config"} == first  # the parsed flags stay as parsed
    resolved = {k: v for k, v in vars(flags).items() if k != "config"}
    assert resolved["generate_max_len"] == 64 and first["generate_max_len"] is None  # resolution changed it
    path = write_resolved_config(flags, str(tmp_path / "run"))
    saved = json.load(open(path))
    assert saved["use_wandb"] is True and "secret-key" not in open(path).read()
    assert saved["_as_parsed"]["generate_max_len"] is None and saved["generate_max_len"] == 64

    replay = p.parse(["--config", path, "--use_wandb", "secret-key"])
    assert {k: v for k, v in vars(replay).items() if k != "config"} == first
    assert {k: v for k, v in vars(resolve(replay, 1)).items() if k != "config"} == resolved


def test_namespace_not_from_parse_writes_no_as_parsed(tmp_path):
    path = write_resolved_config(argparse.Namespace(learning_rate=1.0), str(tmp_path))
    assert json.load(open(path)) == {"learning_rate": 1.0, "use_wandb": False}
