"""The example user files ship inside the package (rlhfkit/examples) and the repository's examples/
holds the same files; `python -m rlhfkit.examples` lists them; the packaging files name what exists."""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys


import pytest
from helpers import ROOT, subprocess_env

from rlhfkit.examples import FILES, path

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def test_examples_folder_holds_the_packaged_files():
    for name in FILES:
        repo = os.path.join(ROOT, "examples", name)
        assert os.path.isfile(repo), name
        assert filecmp.cmp(repo, path(name), shallow=False), f"examples/{name} differs from rlhfkit/examples/{name}"
    shipped = {f for f in os.listdir(os.path.dirname(path("reward_func.py")))
               if f.endswith(".py") and not f.startswith("__")}
    assert shipped == {n for n in FILES if "/" not in n}  # every file is listed


def test_module_prints_the_paths():
    out = subprocess.run([sys.executable, "-m", "rlhfkit.examples"], env=subprocess_env(), capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert [line.split("\t")[0] for line in out] == [path(n) for n in FILES]
    assert all(os.path.isfile(line.split("\t")[0]) for line in out)


def test_packaging_names_the_license_and_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["license"] == "Apache-2.0" and meta["project"]["license-files"] == ["LICENSE"]
    assert meta["tool"]["setuptools"]["package-data"]["rlhfkit.examples"] == ["scripts/*.sh"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_dockerfile_copies_what_exists_and_names_real_extras():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert os.path.exists(os.path.join(ROOT, src)), src
    wanted = re.search(r"^ARG EXTRAS=(\S+)$", text, re.M).group(1).split(",")
    assert set(wanted) <= extras, set(wanted) - extras
    assert re.search(r"^FROM nvidia/cuda:\S+$", text, re.M)
