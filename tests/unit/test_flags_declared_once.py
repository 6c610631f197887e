"""Each flag name is declared exactly once in rlhfkit/ (issue #44): a flag several commands share is
declared by one function of rlhfkit.config.flags, which takes what differs between the commands as
parameters; a command's own default is set with `p.set_defaults`, never by declaring the flag again.

The walker reads the source (AST) of every `.flag(...)` / `.add_argument(...)` call and collects the
literal option strings among its positional arguments (also inside `*(("--alias",) if x else ())`);
names built at run time (f-strings, variables) are not literals and are not counted."""

from __future__ import annotations

import ast
import os
from collections import defaultdict

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


def declarations(source: str, where: str = "<string>") -> dict[str, list[str]]:
    """Option string -> the places (`where:line`) of the calls that declare it."""
    out: dict[str, list[str]] = defaultdict(list)
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    for node in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node.func, ast.Attribute) and node.func.attr in CALLS:
            for name in dict.fromkeys(n for arg in node.args for n in _literals(arg)):
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
