"""Write rlhfkit/api/flag_fields.py, the API configs' typed fields, from the commands' flag tables.

    python -m rlhfkit.api.gen_fields            # rewrite rlhfkit/api/flag_fields.py
    python -m rlhfkit.api.gen_fields --check    # exit 1 when the committed file differs

For each command of `COMMANDS`, its `build_parser()` is read as argparse sees it and becomes one
dataclass with a field per flag dest (the flat name: `learning_rate`, `n_samples_per_prompt`, ...):

    type      from the flag's action: `type=int` -> int, a store_true flag -> bool, nargs -> list[...],
              choices -> Literal[...], a None default -> `... | None`
    default   the parser's default, so the API and the CLI can never disagree
    docstring the flag's help line and all of its names (what an editor shows on hover)

The command's inputs (model path, datasets, reward file) are not fields: the trainers take them as
objects. Hugging Face TRL's names that mean the same as a flag (`TRL_NAMES`) are init-only
arguments of the configs that have the flag but not the name (rlhfkit.api.config.trl_names).
The generated module is committed, so editors and type checkers read it without running anything;
tests/unit/test_api_fields.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from rlhfkit.api.config import TRL_NAMES, command_parser, flag_dests

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flag_fields.py")

# command -> (class name, the dests that are trainer arguments rather than fields)
OFFLINE_INPUTS = ("pretrain", "dataset", "eval_dataset")
COMMANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "train_sft": ("TrainSFTFields", OFFLINE_INPUTS),
    "train_rm": ("TrainRMFields", OFFLINE_INPUTS),
    "train_dpo": ("TrainDPOFields", OFFLINE_INPUTS),
    "train_kto": ("TrainKTOFields", OFFLINE_INPUTS),
    "train_ppo": ("TrainPPOFields", ("pretrain", "prompt_data", "eval_dataset", "remote_rm_url")),
}
NOT_FIELDS = ("config",)  # --config FILE: the API's config is the object itself

HEADER = '''"""The Python API configs' fields: one dataclass per command, one typed, documented field per flag.

Generated from the commands' flag tables by `python -m rlhfkit.api.gen_fields`; do not edit by hand
(tests/unit/test_api_fields.py checks that it is up to date). The configs users build
(rlhfkit.api.offline, rlhfkit.api.rl) subclass these; rlhfkit.api.config has their behaviour.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import ClassVar, Literal

from rlhfkit.api.config import FlagConfig, trl_names
'''


def py(value: Any) -> str:
    """`value` as Python source, strings in double quotes."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(py(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def _scalar(action: argparse.Action) -> str:
    if action.choices:
        return f"Literal[{', '.join(py(c) for c in action.choices)}]"
    t = action.type
    if t in (int, float, str):
        return t.__name__
    if getattr(t, "__name__", "") == "str2bool":
        return "bool"
    raise TypeError(f"--{action.dest}: no Python type for argparse type {t!r}; add one to gen_fields._scalar")


def field_type(actions: list[argparse.Action]) -> str:
    """The annotation of a dest set by `actions` (see module doc)."""
    main = next((a for a in actions if a.nargs != 0), None)
    if main is None:
        kinds = {type(a.const) for a in actions}
        if kinds != {bool}:
            raise TypeError(f"--{actions[0].dest}: on/off flags with constants {kinds}")
        return "bool"
    t = _scalar(main)
    if main.nargs not in (None, "?"):
        t = f"list[{t}]"
    if main.default is None:
        t += " | None"
    return t


def field_default(actions: list[argparse.Action], parser: Any) -> str:
    d = parser.get_default(actions[0].dest)
    if isinstance(d, list):
        return f"field(default_factory=lambda: {py(d)})"
    return py(d)


def field_doc(dest: str, actions: list[argparse.Action], inert: dict[str, str]) -> str:
    main = next((a for a in actions if a.nargs != 0), actions[0])
    text = (main.help or "").replace("%%", "%")
    names = [n for a in actions if a.nargs != 0 or a is main for n in a.option_strings]
    consts = [f"{a.option_strings[0]} sets {py(a.const)}" for a in actions if a.nargs == 0 and a is not main]
    where = ", ".join(names) + (f"; {', '.join(consts)}" if consts else "")
    if dest in inert and "no effect" not in text:
        text += f"; no effect: {inert[dest]}"
    doc = f"{text} [{where}]".replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    return doc


def _wrap(doc: str, indent: str = "    ", width: int = 116) -> list[str]:
    words, lines, cur = doc.split(" "), [], ""
    for w in words:
        if cur and len(indent) + 3 + len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    lines.append(cur)
    if len(lines) == 1:
        return [f'{indent}"""{lines[0]}"""']
    return [f'{indent}"""{lines[0]}'] + [f"{indent}{x}" for x in lines[1:-1]] + [f'{indent}{lines[-1]}"""']


def generate_class(command: str, cls_name: str, inputs: tuple[str, ...]) -> list[str]:
    parser = command_parser(command)
    dests = flag_dests(parser)
    inert = getattr(parser, "inert", {})
    inputs_shown = ", ".join(f"--{d}" for d in inputs)
    out = ["", "", "@trl_names", "@dataclass(repr=False, kw_only=True)", f"class {cls_name}(FlagConfig):",
           f'    """The flags of `python -m rlhfkit.cli.{command}` as fields, with its defaults; the inputs',
           f'    ({inputs_shown}) are the trainer\'s arguments."""', "",
           f"    COMMAND: ClassVar[str] = {py(command)}", f"    INPUTS: ClassVar[tuple[str, ...]] = {py(inputs)}"]
    seen: set[str] = set()
    for group in parser.ordered_groups():
        names = []
        for a in group._group_actions:
            if a.dest in dests and a.dest not in seen and a.dest not in inputs and a.dest not in NOT_FIELDS:
                seen.add(a.dest)
                names.append(a.dest)
        if not names:
            continue
        out += ["", f"    # {group.title}"]
        for dest in names:
            acts = dests[dest]
            out.append(f"    {dest}: {field_type(acts)} = {field_default(acts, parser)}")
            out += _wrap(field_doc(dest, acts, inert))
    aliases = [(trl, ours) for trl, ours in TRL_NAMES.items() if ours in seen and trl not in dests]
    if aliases:
        out += ["", "    # Hugging Face TRL's names for the same settings (init-only; reading one reads ours)"]
        for trl, ours in aliases:
            out.append(f"    {trl}: InitVar[{field_type(dests[ours]).removesuffix(' | None')} | None] = None")
            out.append(f'    """TRL\'s name for `{ours}`"""')
    missing = set(dests) - seen - set(inputs) - set(NOT_FIELDS)
    if missing:
        raise RuntimeError(f"{command}: flags outside every help group: {sorted(missing)}")
    return out


def generate() -> str:
    lines = HEADER.splitlines()
    for command, (cls_name, inputs) in COMMANDS.items():
        lines += generate_class(command, cls_name, inputs)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = generate()
    if "--check" in argv:
        with open(OUT) as f:
            if f.read() != text:
                print(f"{OUT} is stale: run python -m rlhfkit.api.gen_fields", file=sys.stderr)
                return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
