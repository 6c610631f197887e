"""No import cycle among rlhfkit's modules, type-only imports (under `if TYPE_CHECKING:`) and imports inside
functions included: every `import` statement of every module is an edge. A cycle means two modules that
cannot be understood, tested or moved one without the other. `LAYERS`: packages whose modules import one way
(a lower layer never imports a higher one), by the same edges."""

from __future__ import annotations

import ast
from pathlib import Path

import rlhfkit

ROOT = Path(rlhfkit.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The rlhfkit modules `name` imports (a name imported from a package is its submodule where one exists)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_type_only_and_function_imports_are_edges(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhfkit.types import Trajectory\n\n"
                   "def f():\n    import rlhfkit.fileio\n")
    modules = {"rlhfkit.m": src, "rlhfkit.types": src, "rlhfkit.fileio": src}
    assert _imports("rlhfkit.m", src, modules) == {"rlhfkit.types", "rlhfkit.fileio"}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 100 and graph["rlhfkit.agents.base"]  # the walk found the package and its edges
    assert cycles(graph) == []


LAYERS = [  # (package, packages it must not import): the lower layer never reaches up
    ("rlhfkit.rollout.builtin.kernels", ("rlhfkit.rollout.builtin.model", "rlhfkit.rollout.builtin.loop")),
    ("rlhfkit.rollout.builtin.model", ("rlhfkit.rollout.builtin.loop",)),
    ("rlhfkit.usercode", ("rlhfkit.rewards", "rlhfkit.agents")),
    ("rlhfkit.rewards", ("rlhfkit.agents",)),
]


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_layers_import_one_way():
    modules = _modules()
    wrong = []
    for package, above in LAYERS:
        for name, path in modules.items():
            if _under(name, package):
                wrong += [f"{name} -> {t}" for t in sorted(_imports(name, path, modules))
                          if any(_under(t, a) for a in above)]
    assert wrong == []
