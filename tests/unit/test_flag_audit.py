"""The flag audit: every flag of every command is read by the code the command runs, or says why not.

Method (static; no command is run):

1. The flags: each command in `rlhfkit.cli.main.COMMANDS`, its `build_parser()`, every option's dest.
2. The code the command can run: the rlhfkit modules its module imports, transitively (imports inside
   functions included), parsed with `ast`. Inside them a name-based call graph starting from the
   command's own module: a function or method counts when counted code names it (a call, an
   attribute, a reference passed along), a named class counts with all its methods, decorated
   functions (registries) and module-level code count. So a read in a helper that the command never
   reaches does not count, as a grep over imported modules would.
3. The reads in counted code: `args.<dest>` / `ns.<dest>` loads, `getattr(args, "<dest>", ...)`, and
   `from_args(Config, args, **overrides)`, which reads every field of the dataclass `Config` not
   overridden.
4. A dest passes when it is read, or the parser declares it inert (`FlagParser.inert`: parsing prints
   one note naming it; `test_inert_flags_print_one_note` checks that for every inert flag of every
   command), or it is in a note table whose printing function the command reaches (`NOTE_TABLES`).

What this cannot see is a read whose value is then ignored; the behaviour tests are for that
(tests/integration/test_flag_effects.py, tests/unit/test_backend_ema.py, test_aux_loss.py, ...).
`test_audit_reports_an_unread_flag` shows the audit fails on a flag nobody reads.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass, field

import pytest

from rlhfkit.cli.main import COMMANDS

ARG_NAMES = {"args", "ns"}  # the names the code gives the parsed namespace
# note tables: (module, names of the tables in it, the function that prints their notes)
NOTE_TABLES = [("rlhfkit.config.rl_flags", ("RAY_ONLY",), "note_ray_only_flags"),
               ("rlhfkit.rl_run.ray_layout", ("VLLM_ONLY", "NO_EFFECT"), "note_no_effect")]
PROGS = sorted(set(COMMANDS.values()))


@dataclass
class Unit:
    """A function, a method, a class body or a module's top-level code."""

    name: str
    reads: set[str] = field(default_factory=set)
    configs: list[tuple[str, set[str]]] = field(default_factory=list)  # from_args(Config, ..., **overrides)
    refs: set[str] = field(default_factory=set)
    root: bool = False  # counts whatever names it (module-level code, decorated functions)


def _scan(unit: Unit, node: ast.AST) -> Unit:
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            unit.refs.add(n.id)
        elif isinstance(n, ast.Attribute):
            unit.refs.add(n.attr)
            if isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name) and n.value.id in ARG_NAMES:
                unit.reads.add(n.attr)
        if not isinstance(n, ast.Call):
            continue
        fn = n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else ""
        if (fn == "getattr" and len(n.args) >= 2 and isinstance(n.args[0], ast.Name) and n.args[0].id in ARG_NAMES
                and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)):
            unit.reads.add(n.args[1].value)
        elif fn == "from_args" and n.args and len(n.args) >= 2:
            cls = n.args[0]
            name = cls.id if isinstance(cls, ast.Name) else cls.attr if isinstance(cls, ast.Attribute) else ""
            unit.configs.append((name, {k.arg for k in n.keywords if k.arg}))
    return unit


@dataclass
class Module:
    units: list[Unit]
    imports: set[str]
    dataclasses: dict[str, set[str]]  # dataclass name -> field names
    bases: dict[str, list[str]] = field(default_factory=dict)  # dataclass name -> its bases' names


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of a (possibly relative) `from ... import`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if _is_package(module) else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return bool(spec and spec.submodule_search_locations)


@functools.lru_cache(maxsize=None)
def parse_module(name: str) -> Module:
    spec = importlib.util.find_spec(name)
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    units, imports, dcs, bases = [], set(), {}, {}
    top = Unit(f"<module {name}>", root=True)
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            units.append(_scan(Unit(stmt.name, root=bool(stmt.decorator_list)), stmt))
        elif isinstance(stmt, ast.ClassDef):
            cls = Unit(stmt.name, root=bool(stmt.decorator_list))
            for item in stmt.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    units.append(_scan(Unit(item.name), item))
                    cls.refs.add(item.name)  # a class that is named brings all its methods
                else:
                    _scan(cls, item)
            units.append(cls)
            if any("dataclass" in ast.unparse(d) for d in stmt.decorator_list):
                dcs[stmt.name] = {i.target.id for i in stmt.body
                                  if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
                bases[stmt.name] = [b.id if isinstance(b, ast.Name) else ast.unparse(b).split(".")[-1]
                                    for b in stmt.bases]
        else:
            _scan(top, stmt)
    units.append(top)
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            imports.update(a.name for a in n.names if a.name.startswith("rlhfkit"))
        elif isinstance(n, ast.ImportFrom):
            mod = _resolve(name, n)
            if mod.startswith("rlhfkit"):
                imports.add(mod)
                imports.update(f"{mod}.{a.name}" for a in n.names if _exists(f"{mod}.{a.name}"))
    return Module(units, {m for m in imports if _exists(m)}, dcs, bases)


@functools.lru_cache(maxsize=None)
def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def reachable_modules(start: str) -> list[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # packages' __init__ run first
        todo.extend(parse_module(m).imports - seen)
    return sorted(seen)


@dataclass
class Audit:
    reads: set[str]
    reached: set[str]  # names of the counted units


def audit(prog: str) -> Audit:
    """The flag reads of the code command `prog` can run (module docstring, steps 2-3)."""
    start = f"rlhfkit.cli.{prog}"
    modules = {m: parse_module(m) for m in reachable_modules(start)}
    by_name: dict[str, list[Unit]] = {}
    for mod in modules.values():
        for u in mod.units:
            by_name.setdefault(u.name, []).append(u)
    dcs: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for mod in modules.values():
        for k, v in mod.dataclasses.items():
            dcs.setdefault(k, set()).update(v)
            bases.setdefault(k, []).extend(mod.bases.get(k, []))

    def fields_of(name: str, seen: frozenset[str] = frozenset()) -> set[str]:  # own and inherited fields
        own = set(dcs.get(name, set()))
        for b in bases.get(name, []):
            if b not in seen:
                own |= fields_of(b, seen | {name})
        return own

    todo = [u for m, mod in modules.items() for u in mod.units if u.root or m == start]
    counted: set[int] = set()
    reads: set[str] = set()
    reached: set[str] = set()
    while todo:
        u = todo.pop()
        if id(u) in counted:
            continue
        counted.add(id(u))
        reached.add(u.name)
        reads |= u.reads
        for cname, overrides in u.configs:
            reads |= fields_of(cname) - overrides
        for ref in u.refs:
            todo.extend(v for v in by_name.get(ref, ()) if id(v) not in counted)
    return Audit(reads, reached)


def noted_by_tables(reached: set[str]) -> set[str]:
    out: set[str] = set()
    for module, tables, printer in NOTE_TABLES:
        if printer in reached:
            mod = importlib.import_module(module)
            for t in tables:
                out.update(getattr(mod, t))
    return out


def parser_of(prog: str):
    return importlib.import_module(f"rlhfkit.cli.{prog}").build_parser()


def dests(parser) -> dict[str, str]:
    """dest -> first option name, for every option of `parser` but --help."""
    out = {}
    for a in parser._actions:
        if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            out.setdefault(a.dest, a.option_strings[0])
    return out


def unaccounted(prog: str, parser) -> list[str]:
    a = audit(prog)
    covered = a.reads | set(parser.inert) | noted_by_tables(a.reached)
    return sorted(opt for d, opt in dests(parser).items() if d not in covered)


@pytest.mark.parametrize("prog", PROGS)
def test_every_flag_is_read_or_noted(prog):
    missing = unaccounted(prog, parser_of(prog))
    assert not missing, (f"{prog}: flags that no code of the command reads and that print no note: "
                         f"{', '.join(missing)} (read them, or declare them with inert='why' / p.mark_inert)")


def test_audit_reports_an_unread_flag():
    p = parser_of("train_sft")
    p.flag("--audit_canary_flag", type=int, default=0)
    p.flag("--quickstart_digits", dest="digits", type=int, default=2)  # read by quickstart only
    assert unaccounted("train_sft", p) == ["--audit_canary_flag", "--quickstart_digits"]
    p.mark_inert("audit_canary_flag", "a test flag")
    assert unaccounted("train_sft", p) == ["--quickstart_digits"]


def test_call_graph_is_narrower_than_the_imports():
    """A helper of an imported module is not counted unless the command reaches it: batch_inference
    imports rlhfkit.cli.common but does not run check_backend_flags."""
    a = audit("batch_inference")
    assert "resolve_modelscope_paths" in a.reached and "check_backend_flags" not in a.reached
    assert "ring_attn_size" not in a.reads  # read by check_backend_flags only


def _set_value(action: argparse.Action) -> list[str]:
    """Arguments that give `action`'s dest a value other than its default."""
    opt = action.option_strings[0]
    if action.nargs == 0:
        return [opt]
    if action.choices:
        return [opt, next(str(c) for c in action.choices if c != action.default)]
    if action.type in (int, float):
        value = [str((action.default or 0) + 1)]
    else:
        value = ["x"]
    n = action.nargs if isinstance(action.nargs, int) else 1
    return [opt, *(value * n)]


def _required_argv(parser) -> list[str]:
    return [x for a in parser._actions if a.required and a.option_strings for x in (a.option_strings[0], "x")]


@pytest.mark.parametrize("prog", PROGS)
def test_inert_flags_print_one_note(prog, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    parser = parser_of(prog)
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    for dest in parser.inert:
        opt = actions[dest].option_strings[0]
        ns = parser.parse(_required_argv(parser) + _set_value(actions[dest]))
        assert getattr(ns, dest) != parser.get_default(dest)
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note:")]
        assert lines == [f"note: {opt} has no effect: {parser.inert[dest]}"], (prog, dest, lines)
    parser.parse(_required_argv(parser))  # defaults: no note
    assert "note:" not in capsys.readouterr().out


def test_no_note_on_other_ranks(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    parser_of("train_sft").parse(["--zpg", "4"])
    assert "note:" not in capsys.readouterr().out


def test_note_tables_name_existing_flags():
    for module, tables, _ in NOTE_TABLES:
        mod = importlib.import_module(module)
        known = set(dests(parser_of("train_ppo_ray")))
        for t in tables:
            assert set(getattr(mod, t)) <= known, (module, t)


def test_every_command_module_exists():
    for prog in PROGS:
        assert os.path.isfile(importlib.util.find_spec(f"rlhfkit.cli.{prog}").origin)
