"""The import graph of rlhfkit has no cycles (the package as a whole, and `rlhfkit.agents` and
`rlhfkit.models` named on their own), counting imports inside functions too (a lazy import that closes a cycle is still one: it hides an order
the modules depend on). Built from the source with `ast`, so nothing is imported to check it.

Leaf modules break what were cycles: `agents/contracts.py` (the agent records and checks),
`agents/episode.py` (the multi-turn loop), `agents/user_file.py` (importing a user's file),
`models/hf_files.py` (dtype names, model-dir checks, tokenizer, weight-file names) and
`models/lora_merge.py` (merging needs the value models, attaching does not)."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "rlhfkit")


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Module -> the rlhfkit modules it imports anywhere (functions included; `if TYPE_CHECKING:`
    blocks left out: annotations only), and the packages above each (their `__init__` runs first)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        with open(path) as fh:
            tree = ast.parse(fh.read())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            for t in targets:
                # importing a.b.c first runs the packages a and a.b: their __init__ imports count too
                for parent in _parents(t):
                    if parent in mods and parent != mod and not mod.startswith(parent + "."):
                        graph[mod].add(parent)
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def cycles_within(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """Strongly connected components (> 1 module) among the modules under `prefix` (Tarjan)."""
    nodes = [m for m in graph if m.startswith(prefix)]
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if not w.startswith(prefix):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", ["rlhfkit.agents.", "rlhfkit.models.", "rlhfkit."])
def test_no_import_cycles(package):
    assert cycles_within(import_graph(), package) == []


def bench_graph() -> dict[str, set[str]]:
    """bench/'s scripts import each other as top-level modules (bench/ on sys.path): module -> the
    bench modules it imports anywhere, functions included."""
    bench = os.path.join(os.path.dirname(ROOT), "bench")
    mods = {f[:-3]: os.path.join(bench, f) for f in os.listdir(bench) if f.endswith(".py")}
    graph: dict[str, set[str]] = {f"bench.{m}": set() for m in mods}
    for mod, path in mods.items():
        with open(path) as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            graph[f"bench.{mod}"] |= {f"bench.{n.split('.')[0]}" for n in names if n.split(".")[0] in mods} - {
                f"bench.{mod}"}
    return graph


def test_no_import_cycles_in_bench():
    graph = bench_graph()
    assert graph["bench.rl_step"] >= {"bench.rl_step_common", "bench.rl_step_ray"}  # the walk sees bench imports
    assert cycles_within(graph, "bench.") == []


def test_the_checker_finds_a_cycle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert cycles_within(graph, "p.") == [["p.a", "p.b", "p.c"]]


def test_first_import_in_a_fresh_interpreter():
    """The graph above is read from the source; this imports for real. `models.hf_files` once took its
    dtype table from `backend.precision`, so a fresh
    `import rlhfkit.models.loader` (as `python -m rlhfkit.cli.lora_combiner` does first) ran backend's
    __init__ -> fsdp2 -> models.loader half-initialised: ImportError. models/ must not import backend/."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.path.dirname(ROOT)}
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], env=env, stderr=subprocess.PIPE, text=True)
             for m in ("rlhfkit.models.loader", "rlhfkit.cli.lora_combiner")}
    errors = {m: p.communicate(timeout=120)[1][-800:] for m, p in procs.items()}
    assert {m: p.returncode for m, p in procs.items()} == {m: 0 for m in procs}, errors
    models_imports = {t for m, ts in import_graph().items() if m.startswith("rlhfkit.models.") for t in ts}
    assert not [t for t in models_imports if t.startswith("rlhfkit.backend")]
