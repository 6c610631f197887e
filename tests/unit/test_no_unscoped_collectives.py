"""No world-wide data reduction in roles/, trainers/, algo/, losses/ or data/.

With tensor or context parallelism the tp / cp ranks of one data-parallel rank hold the same
samples, so a sum over the whole world counts them several times. Reductions there go through
`DistInfo` (`all_reduce_dp`, `all_reduce_loss`, `all_reduce_world` for decisions; see
rlhfkit/parallel/dist.py). This test reads those packages' source (AST) and fails on:

* a torch.distributed collective called without an explicit `group=`;
* an import of the world-wide helpers of rlhfkit.parallel(.dist) (`all_reduce_sum`,
  `broadcast_object`, `barrier`).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "rlhfkit")
PACKAGES = ("roles", "trainers", "algo", "losses", "data")
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
               "monitored_barrier"}
WORLD_HELPERS = {"all_reduce_sum", "broadcast_object", "barrier"}
HELPER_MODULES = {"rlhfkit.parallel.dist", "rlhfkit.parallel"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def violations(source: str, where: str = "<src>") -> list[str]:
    """Unscoped collectives and world-wide helper imports in `source`, one line each."""
    tree = ast.parse(source)
    dist_aliases = {"torch.distributed"}  # names bound to the torch.distributed module
    direct: set[str] = set()  # collective functions imported by name
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    dist_aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            for a in node.names:
                if mod == "torch" and a.name == "distributed":
                    dist_aliases.add(a.asname or a.name)
                elif mod == "torch.distributed" and a.name in COLLECTIVES:
                    direct.add(a.asname or a.name)
                elif mod in HELPER_MODULES and a.name in WORLD_HELPERS:
                    bad.append(f"{where}:{node.lineno}: imports the world-wide {a.name} from {mod}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, op = name.rpartition(".")
        is_collective = (head in dist_aliases and op in COLLECTIVES) or (not head and op in direct)
        if is_collective and not any(k.arg == "group" for k in node.keywords):
            bad.append(f"{where}:{node.lineno}: {name}(...) without group= reduces over the whole world")
    return bad


def _files() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for dirpath, _, names in os.walk(os.path.join(ROOT, pkg)):
            out.extend(os.path.join(dirpath, n) for n in names if n.endswith(".py"))
    return sorted(out)


def test_packages_reduce_only_over_named_groups():
    files = _files()
    assert len(files) > 30, f"only {len(files)} files found under {ROOT}"
    bad = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            bad += violations(f.read(), os.path.relpath(path, os.path.dirname(ROOT)))
    assert not bad, "use DistInfo's scoped reductions (parallel/dist.py):\n" + "\n".join(bad)


@pytest.mark.parametrize("src, n", [
    ("import torch.distributed as dist\ndist.all_reduce(t)\n", 1),
    ("import torch.distributed as tdist\ntdist.all_reduce(t, op=tdist.ReduceOp.MAX)\n", 1),
    ("import torch\ntorch.distributed.all_gather(out, t)\n", 1),
    ("from torch import distributed as d\nd.broadcast_object_list(box, src=0)\n", 1),
    ("from torch.distributed import all_reduce as ar\nar(t)\n", 1),
    ("from rlhfkit.parallel.dist import DistInfo, all_reduce_sum\n", 1),
    ("from rlhfkit.parallel import barrier\n", 1),
    ("import torch.distributed as dist\ndist.all_reduce(t, group=g)\ndist.get_rank()\n", 0),
    ("x = dist_info.all_reduce_dp(t)\nself.dist.all_reduce_world(1, op='max')\n", 0),
])
def test_detector_flags_unscoped_calls(src, n):
    assert len(violations(src)) == n, violations(src)
