"""Flags declared as dataclass fields (rlhfkit.config.declare): the parser a command derives from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from rlhfkit.config.configs import BackendConfig, ModelConfig
from rlhfkit.config.declare import Switch, add_fields, default_of, flag, names_of, flag_fields
from rlhfkit.config.flag_parser import FlagParser


@dataclass
class Demo:
    size: int = flag(3, "--demo.size", group="demo", help="a size")
    ratio: float | None = flag(None, help="a ratio")
    mode: Literal["a", "b"] = flag("a", "--demo.mode", help="a mode",
                                   switches=(Switch(("--use_b", "--demo.use_b"), "b", "alias of --mode b"),))
    pair: list[float] = flag([0.5, 2.0], nargs=2, help="LOW HIGH")
    keys: list[str] = flag(["x"], help="keys")
    on: bool = flag(False, group="other", help="a switch")
    old: int = flag(0, help="an OpenRLHF flag", inert="nothing reads it")
    derived: int = default_of(BackendConfig, "seed")


def parser(**kw) -> FlagParser:
    p = FlagParser("demo")
    add_fields(p, Demo, **kw)
    p.exit_on_error = False
    return p


def test_types_defaults_and_names_come_from_the_field():
    ns = parser().parse(["--demo.size", "5", "--ratio", "0.25", "--use_b", "--pair", "1", "3", "--keys", "a", "b",
                         "--on"], notes=False)
    assert (ns.size, ns.ratio, ns.mode, ns.pair, ns.keys, ns.on) == (5, 0.25, "b", [1.0, 3.0], ["a", "b"], True)
    ns = parser().parse([], notes=False)
    assert (ns.size, ns.ratio, ns.mode, ns.pair, ns.keys, ns.on, ns.old) == (3, None, "a", [0.5, 2.0], ["x"], False, 0)
    assert not hasattr(ns, "derived")  # a plain field is no flag
    assert Demo().pair is not Demo().pair and Demo().derived == BackendConfig().seed
    with pytest.raises(Exception, match="invalid choice: 'c'"):
        parser().parse(["--mode", "c"], notes=False)
    with pytest.raises(Exception, match="invalid int value"):
        parser().parse(["--size", "2.5"], notes=False)


def test_groups_inert_and_the_commands_choices():
    p = parser()
    titles = {a.dest: g.title for g in p._action_groups for a in g._group_actions}
    assert (titles["size"], titles["mode"], titles["on"], titles["old"]) == ("demo", "demo", "other", "other")
    assert p.inert == {"old": "nothing reads it"} and "no effect in demo" in p._option_string_actions["--old"].help
    q = parser(only=["on", "size"], help={"size": "the command's size"}, names={"size": ["--size"]},
               inert={"size": "why"})
    assert [a.dest for a in q._actions if a.dest in ("on", "size")] == ["on", "size"]
    assert "--demo.size" not in q._option_string_actions and q._option_string_actions["--size"].help.startswith(
        "the command's size")
    with pytest.raises(KeyError, match="declares no flag"):
        parser(only=["sise"])
    with pytest.raises(KeyError, match="declares no name"):
        parser(names={"size": ["--sise"]})
    r = FlagParser("r")  # a command's group block wins over the field's group
    with r.group("mine"):
        add_fields(r, Demo, ["size", "mode"])
    assert {g.title for g in r._action_groups if g._group_actions} >= {"mine"}
    assert "demo" not in {g.title for g in r._action_groups}


def test_required_fields(capsys):
    p = parser(only=["size"], required=["size"])
    assert p.get_default("size") is None and p.parse(["--size", "1"], notes=False).size == 1
    with pytest.raises(SystemExit):
        p.parse([], notes=False)
    assert "required: --size/--demo.size" in capsys.readouterr().err


def test_model_config_is_the_declaration():
    """ModelConfig's fields are the model flags: each one's names and default are what the parser has."""
    p = FlagParser("m")
    add_fields(p, ModelConfig)
    for f in flag_fields(ModelConfig):
        for name in names_of(f):
            assert p._option_string_actions[name].dest == f.name
        assert p.get_default(f.name) == getattr(ModelConfig(), f.name)
    assert p.parse(["--bf16", "--ds.lora.rank", "4"], notes=False).lora_rank == 4
    assert BackendConfig().param_dtype == ModelConfig().param_dtype
