"""The help audit: every flag of every command has a help line and sits in a help group; --help shows
groups and defaults; --version prints the package version; flag_reference() gives the same table."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest
from helpers import subprocess_env

import rlhfkit
from rlhfkit.cli.main import COMMANDS, flag_reference
from rlhfkit.config.flag_parser import GENERAL, FlagParser

PROGS = sorted(set(COMMANDS.values()))
UNGROUPED_OK = {"-h", "--version", "--config", "--log_level", "--verbose"}  # the general group's own flags


def parser_of(prog: str) -> FlagParser:
    return importlib.import_module(f"rlhfkit.cli.{prog}").build_parser()


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """'<flag>: no help' / '<flag>: outside a group' for every flag of `parser` that has the problem."""
    out = []
    for g in parser._action_groups:
        for a in g._group_actions:
            if not a.option_strings:
                continue
            name = a.option_strings[0]
            if not (a.help or "").strip() or a.help == argparse.SUPPRESS:
                out.append(f"{name}: no help")
            if g.title == GENERAL and name not in UNGROUPED_OK:
                out.append(f"{name}: outside a group")
    return out


@pytest.mark.parametrize("prog", PROGS)
def test_every_flag_has_help_and_a_group(prog):
    problems = help_problems(parser_of(prog))
    assert not problems, f"{prog}: {'; '.join(problems)}"


def test_the_audit_finds_a_flag_without_help_or_group():
    p = parser_of("train_sft")
    p.add_argument("--canary_no_help", type=int, default=0)  # plain argparse: the general group, no help
    with p.group("extra"):
        p.flag("--canary_grouped", type=int, default=0, help="")
    assert help_problems(p) == ["--canary_no_help: no help", "--canary_no_help: outside a group",
                                "--canary_grouped: no help"]


def test_help_lists_groups_with_defaults():
    text = parser_of("train_ppo").format_help()
    titles = [ln[:-1] for ln in text.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]
    for t in ("general", "model", "LoRA / QLoRA", "data", "training", "optimizer", "RL: rollout (generation)",
              "RL: algorithm (advantages, KL, policy loss)", "RL: reward and agents",
              "RL: Ray placement, engines and weight sync", "evaluation", "checkpoints and output", "logging"):
        assert t in titles, t
    assert titles.index("model") < titles.index("RL: algorithm (advantages, KL, policy loss)") < titles.index("logging")
    algo = text.split("RL: algorithm (advantages, KL, policy loss):")[1].split("\n\n")[0]
    assert "--advantage_estimator, --algo.advantage.estimator" in algo
    assert "(default: gae)" in algo and "(default: 0.2)" in algo  # --eps_clip
    # each name once, then the metavar
    assert "--pretrain, --model.model_name_or_path, --actor.model_name_or_path PRETRAIN" in text
    sft = parser_of("train_sft").format_help()
    assert "(default: 5e-06)" in sft and "(default: 0.9 0.95)" in sft  # --learning_rate, --adam_betas


def test_inert_flags_say_so_in_their_help():
    p = parser_of("train_sft")
    a = p._option_string_actions["--zpg"]
    assert "no effect in train_sft" in a.help and "DeepSpeed" in a.help


def test_package_version_is_the_pyproject_version():
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml")) as f:
        version = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    assert rlhfkit.__version__ == version


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        parser_of("train_dpo").parse(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"rlhfkit {rlhfkit.__version__}"


@pytest.mark.parametrize("argv", [["rlhfkit.cli.main", "--version"], ["rlhfkit.cli.train_sft", "--version"]])
def test_version_from_the_command_line(argv):
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120,
                       env=subprocess_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"rlhfkit {rlhfkit.__version__}"


def test_flag_reference_covers_every_flag():
    ref = flag_reference()
    assert sorted(ref) == PROGS
    for prog, entry in ref.items():
        parser = parser_of(prog)
        names = {n for g in entry["groups"] for f in g["flags"] for n in f["names"]}
        want = {s for a in parser._actions for s in a.option_strings
                if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))}
        assert names == want, prog
        assert all(f["help"] for g in entry["groups"] for f in g["flags"]), prog
    ppo = {f["names"][0]: f for g in ref["train_ppo"]["groups"] for f in g["flags"]}
    assert ppo["--n_samples_per_prompt"]["default"] == 1 and ppo["--kl_estimator"]["choices"] == ["k1", "k2", "k3"]
    assert ppo["--vllm_generate_batch_size"]["inert"] and not ppo["--temperature"]["inert"]


def test_console_script_help_lists_every_command(capsys):
    from rlhfkit.cli.main import main

    main(["--help"])
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split(None, 2) for ln in out.splitlines() if ln.startswith("  ") and len(ln.split()) > 2}
    for cmd, module in COMMANDS.items():
        assert rows[cmd][1] == module, cmd
    assert rows["sft"][2] == "Supervised fine-tuning" and rows["chat"][2] == "Chat with a model in the terminal"
