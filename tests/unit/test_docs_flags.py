"""docs/flags/*.md (the generated flag reference) is up to date with the parsers, and the generator
renders groups, aliases, defaults, choices and inert notes as documented."""

from __future__ import annotations

import importlib.util
import os

from helpers import ROOT

from rlhfkit.config.flags import FlagParser


def _gen():
    spec = importlib.util.spec_from_file_location("gen_flags", os.path.join(ROOT, "docs", "gen_flags.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_flag_reference_is_up_to_date():
    gen = _gen()
    files = gen.generate()
    assert {"train_sft.md", "train_ppo.md", "train_ppo_ray.md", "make_data.md", "README.md"} <= set(files)
    assert gen.stale(files) == [], "run: python docs/gen_flags.py"


def test_render_groups_aliases_defaults_and_notes():
    p = FlagParser("demo", "Demo command.\n\nMore text.")
    g = p.add_argument_group("model")
    g.add_argument("--pretrain", "--model.model_name_or_path", dest="pretrain", default=None, help="model | dir")
    p.flag("--beta", type=float, default=0.1, help="beta (default %(default)s)")
    p.flag("--loss", default="sigmoid", choices=["sigmoid", "logexp"])
    p.flag("--bf16", dest="param_dtype", action="store_const", const="bf16")
    p.flag("--template", default="User: {}\n", help="prompt format")
    p.flag("--packing", action="store_true", inert="always packed")
    text = _gen().render_parser(p, "demo", "d")
    lines = text.splitlines()
    assert lines[0] == "# `demo` flags" and "Demo command." in lines and "More text." not in text
    # "general" (--version, --config) first, the added group, then flags outside any group; no -h
    assert [ln for ln in lines if ln.startswith("## ")] == ["## general", "## model", "## demo options"]
    assert "| `--pretrain` | `--model.model_name_or_path` |  | model \\| dir |" in lines
    assert "| `--beta` |  | `0.1` | beta (default 0.1) |" in lines
    assert "| `--loss` |  | `sigmoid` | one of: sigmoid, logexp |" in lines
    assert "| `--bf16` |  |  | sets `param_dtype` to `bf16` |" in lines
    assert '| `--template` |  | `"User: {}\\n"` | prompt format |' in lines
    assert "| `--packing` |  | `off` | accepted for OpenRLHF command lines; no effect in demo: always packed |" in lines
    assert "-h" not in text
