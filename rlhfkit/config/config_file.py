"""`--config FILE`: flag values from a YAML or JSON file, overridden by the command line.

    # run.yaml                              keys: flag names, flat or dotted, with or without --
    pretrain: ./tiny                        nested mappings are dotted names:
    actor:                                  {actor: {adam: {lr: 1e-6}}} == --actor.adam.lr 1e-6
      adam: {lr: 1.0e-6}
    bf16: true                              a switch: true gives it, false leaves it out
    target_modules: [q_proj, v_proj]        a flag of several values: a list

The file's values become the parser's defaults for this parse, so every flag on the command line
wins over the file. A key that names no flag, a value of the wrong type or outside the flag's
choices, and two keys for one setting with different values are errors naming the key and the file
(exit code 2).

A run's `run_config.json` (rlhfkit.config.flags.write_resolved_config) is such a file: its keys are
the flags' dests with their resolved values, and `_as_parsed` holds the values the command line
gave where the command then filled derived defaults (train_ppo's --generate_max_len, --ema_beta,
...), so replaying it parses to the same namespace and resolves to the same config. Its `config`
key (the file that run read) is skipped; `use_wandb` is stored as a bool (never the API key).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any

META_KEYS = ("_as_parsed", "config")


def config_path(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The --config value of `argv` (None without one), read before the other flags: a parser of
    `parser`'s own --config flag alone (declared once, by FlagParser) reads it."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre._add_action(copy.copy(parser._option_string_actions["--config"]))
    ns, _ = pre.parse_known_args(argv)
    return ns.config


def read(path: str) -> dict[str, Any]:
    """The file's mapping with nested mappings flattened to dotted keys; a bad file raises ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {path}: not valid JSON ({e})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"--config {path}: reading YAML needs pyyaml (pip install pyyaml), "
                             "or give a .json file") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    parsed = data.pop("_as_parsed", None) if path.endswith(".json") else None
    for k in META_KEYS:
        data.pop(k, None)
    if isinstance(parsed, dict):
        data.update(parsed)
    return _flatten(data)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{str(k).lstrip('-')}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _actions_of(parser: argparse.ArgumentParser, dest: str) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest == dest and a.option_strings]


def _value_action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    """The action that takes `dest`'s value from the command line (else the first switch of it)."""
    acts = _actions_of(parser, dest)
    return next((a for a in acts if a.nargs != 0), acts[0])


def resolve(parser: argparse.ArgumentParser, data: dict[str, Any], path: str) -> dict[str, tuple[str, Any]]:
    """dest -> (key, value) for the file's keys; raises ValueError naming the key and `path`."""
    dests = {a.dest for a in parser._actions if a.option_strings}
    out: dict[str, tuple[str, Any]] = {}
    for key, value in data.items():
        where = f"--config {path}: key '{key}'"
        if key == "use_wandb" and isinstance(value, bool):  # run_config.json: bool, never the key itself
            value = "True" if value else None
        if key in dests:
            action = _value_action(parser, key)
            dest, value = key, _coerce_dest(action, value, where)
        elif f"--{key}" in parser._option_string_actions:
            action = parser._option_string_actions[f"--{key}"]
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                raise ValueError(f"{where}: --{key} cannot be set from a file")
            dest = action.dest
            if action.nargs == 0:
                value = _switch(action, value, where)
                if value is _UNSET:
                    continue
            else:
                value = _coerce(action, value, where)
        else:
            import difflib

            names = [s.lstrip("-") for s in parser._option_string_actions if s.startswith("--")]
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"{where} is not a flag of {parser.prog}{hint}")
        if dest in out and out[dest][1] != value:
            raise ValueError(f"--config {path}: keys '{out[dest][0]}' and '{key}' conflict: both set "
                             f"--{dest}; keep one of them")
        out[dest] = (key, value)
    return out


_UNSET = object()


def _switch(action: argparse.Action, value: Any, where: str) -> Any:
    """A flag without a value (`--bf16`, `--gradient_checkpointing`): true gives it; false leaves a
    constant switch out and sets a true/false switch's setting to the opposite."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if isinstance(action.const, bool):
        return action.const if value else (not action.const)
    return action.const if value else _UNSET


def _coerce_dest(action: argparse.Action, value: Any, where: str) -> Any:
    """A dest's value as stored in a namespace (run_config.json)."""
    if action.nargs == 0:
        if isinstance(action.const, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: expected true or false, got {value!r}")
            return value
        if value not in (action.const, action.default):
            raise ValueError(f"{where}: expected {action.const!r}, got {value!r}")
        return value
    return _coerce(action, value, where)


def _coerce(action: argparse.Action, value: Any, where: str) -> Any:
    if value is None:
        return None
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value] if action.nargs in ("*", "+") else None
        if items is None or (isinstance(action.nargs, int) and len(items) != action.nargs):
            raise ValueError(f"{where}: expected a list of {action.nargs} values, got {value!r}")
        return [_one(action, v, where) for v in items]
    if isinstance(value, (list, dict)):
        raise ValueError(f"{where}: expected one value, got {value!r}")
    return _one(action, value, where)


_KINDS: dict[object, str] = {int: "an integer", float: "a number", str: "a string"}


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    typ = action.type or str
    if isinstance(typ, str):  # a name in argparse's type registry: no flag of rlhfkit declares one
        raise TypeError(f"{where}: the flag's type is the registry name {typ!r}, not a callable")
    kind = _KINDS.get(typ, "a value")
    if isinstance(value, bool) and typ in _KINDS:
        raise ValueError(f"{where}: expected {kind}, got {value!r}")
    try:
        out = typ(value) if isinstance(value, str) or typ in (int, float, str) else value
        if typ is int and isinstance(value, float) and value != int(value):
            raise ValueError
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise ValueError(f"{where}: expected {kind}, got {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{where}: {out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def apply(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Make the file's values `parser`'s defaults; returns what `restore` needs. Errors exit with code 2."""
    try:
        values = resolve(parser, read(path), path)
    except ValueError as e:
        parser.error(str(e))
    defaults: dict[str, list[tuple[argparse.Action, Any]]] = {}
    required: list[argparse.Action] = []
    for dest, (_, value) in values.items():
        defaults[dest] = [(a, a.default) for a in _actions_of(parser, dest)]
        for a in _actions_of(parser, dest):
            a.default = value
            if a.required:
                a.required = False
                required.append(a)
    return {"defaults": defaults, "required": required}


def restore(parser: argparse.ArgumentParser, saved: dict[str, Any]) -> None:
    """Put back the defaults and required marks `apply` changed (notes compare against real defaults)."""
    for pairs in saved["defaults"].values():
        for a, default in pairs:
            a.default = default
    for a in saved["required"]:
        a.required = True
