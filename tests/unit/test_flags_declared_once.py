"""Each flag name is declared exactly once in rlhfkit/ (issue #44): a flag several commands share is
declared by one dataclass field (rlhfkit.config.declare) or one function of rlhfkit.config.flags, which
take what differs between the commands as parameters; a command's own default is set with
`p.set_defaults`, never by declaring the flag again.

The walker reads the source (AST) of every rlhfkit module:
- parser tables: every `.flag(...)` / `.add_argument(...)` call; the literal option strings among its
  positional arguments (also inside `*(("--alias",) if x else ())`);
- dataclasses: every field `name: T = flag(default, "--alias", ..., switches=(Switch("--x", ...),))`;
  its flat name `--name`, the literal aliases and the switches' names.
Names built at run time (f-strings, variables) are not literals and are not counted."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
from collections import defaultdict

import pytest
from helpers import ROOT

CALLS = ("flag", "add_argument")


def _literals(node: ast.AST):
    """String constants that look like option names, not looking into f-strings or nested calls."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str) and node.value.startswith("-"):
            yield node.value
        return
    if isinstance(node, (ast.JoinedStr, ast.Call)):
        return
    for child in ast.iter_child_nodes(node):
        yield from _literals(child)


def _field_names(node: ast.AnnAssign) -> list[str]:
    """The names a dataclass field `x: T = flag(...)` declares (empty for any other assignment)."""
    call = node.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "flag"
            and isinstance(node.target, ast.Name)):
        return []
    names = [f"--{node.target.id}", *(n for arg in call.args for n in _literals(arg))]
    for kw in call.keywords:
        if kw.arg == "switches":
            switches = [c for c in ast.walk(kw.value) if isinstance(c, ast.Call)]
            names += [n for c in switches if c.args for n in _literals(c.args[0])]
    return names


def declarations(source: str, where: str = "<string>") -> dict[str, list[str]]:
    """Option string -> the places (`where:line`) of the calls and fields that declare it."""
    out: dict[str, list[str]] = defaultdict(list)
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Call, ast.AnnAssign))]
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node, ast.AnnAssign):
            names = _field_names(node)
        elif isinstance(node.func, ast.Attribute) and node.func.attr in CALLS:
            names = [n for arg in node.args for n in _literals(arg)]
        else:
            continue
        for name in dict.fromkeys(names):
            out[name].append(f"{where}:{node.lineno}")
    return out


def duplicates(decls: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: places for name, places in sorted(decls.items()) if len(places) > 1}


def package_declarations() -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    pkg = os.path.join(ROOT, "rlhfkit")
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                with open(path, encoding="utf-8") as f:
                    for name, places in declarations(f.read(), os.path.relpath(path, ROOT)).items():
                        out[name] += places
    return out


def test_each_flag_name_is_declared_once():
    decls = package_declarations()
    assert len(decls) > 300, "the walker finds the flag tables"  # a sanity check of the walker itself
    assert {"--seed", "--param_dtype", "--ds.param_dtype", "--max_len", "--value_head_prefix"} <= set(decls)
    dups = duplicates(decls)
    assert not dups, "declared more than once (declare it in one function, see rlhfkit.config.flags):\n" + "\n".join(
        f"  {name}: {', '.join(places)}" for name, places in dups.items())


def test_walker_detects_a_planted_duplicate():
    source = '''
def a(p):
    p.flag("--seed", "--train.seed", type=int, default=42, help="seed")
    p.flag("--device", type=str, help=f"--{p.prog} device")


def b(p, rl):
    with p.group("x"):
        p.flag("--temperature", *(("--rollout.temperature",) if rl else ()), type=float)
    parser.add_argument("--seed", type=int, default=0)
    p.flag(f"--{rl}_num_nodes", "--rollout.temperature")
'''
    decls = declarations(source, "planted.py")
    assert duplicates(decls) == {"--rollout.temperature": ["planted.py:9", "planted.py:11"],
                                 "--seed": ["planted.py:3", "planted.py:10"]}
    assert decls["--device"] == ["planted.py:4"] and "--train.seed" in decls
    assert not any(name.startswith("--{") or name == "--" for name in decls)  # f-strings are not literals


def test_walker_reads_dataclass_fields():
    source = '''
@dataclass
class A:
    seed: int = flag(42, "--train.seed", help="seed")
    dtype: str = flag("bf16", help="d",
                      switches=(Switch("--bf16", "bf16", "alias"), Switch(("--fp", "--x.fp"), "f", "h")))
    plain: int = 3
    other: int = field(default=1)


@dataclass
class B:
    rng: int = flag(0, "--seed", help="another field named --seed")


def c(p):
    p.flag("--bf16", action="store_true")
'''
    decls = declarations(source, "planted.py")
    assert duplicates(decls) == {"--bf16": ["planted.py:5", "planted.py:17"],
                                 "--seed": ["planted.py:4", "planted.py:13"]}
    assert {"--train.seed", "--dtype", "--fp", "--x.fp", "--rng"} <= set(decls)
    assert not {"--plain", "--other"} & set(decls)


@pytest.mark.parametrize("module", ["rlhfkit.config.configs", "rlhfkit.config.rl_flags", "rlhfkit.config.offline_flags",
                                    "rlhfkit.config.flag_parser", "rlhfkit.serving.flags", "rlhfkit.models.tiny_spec"])
def test_walker_finds_what_the_dataclasses_declare(module):
    """The AST walker reads each declaring field as rlhfkit.config.declare does at run time."""
    from rlhfkit.config.declare import flag_fields, names_of

    mod = importlib.import_module(module)
    with open(mod.__file__, encoding="utf-8") as f:
        fields = [n for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.AnnAssign)]
    declared = [n for cls in vars(mod).values() if isinstance(cls, type) and cls.__module__ == mod.__name__
                and dataclasses.is_dataclass(cls) for fld in flag_fields(cls)
                if fld.name in vars(cls).get("__annotations__", {}) for n in names_of(fld)]  # its own fields
    assert len(declared) >= 2
    assert sorted(declared) == sorted(n for node in fields for n in _field_names(node))
