"""The `rlhfkit` console script: one subcommand per CLI module.

    rlhfkit sft --pretrain ... == python -m rlhfkit.cli.train_sft --pretrain ...
    rlhfkit grpo / rloo        train_ppo with the defaults of TRL's GRPOConfig / RLOOConfig
    rlhfkit --version          the package version

`flag_reference()` returns every command's flags by help group, as data, for a generated flag
reference (docs): {module: {"description", "groups": [{"title", "description", "flags": [{"names",
"dest", "default", "help", "choices", "takes_value", "inert"}]}]}}.
"""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys
from typing import Any

COMMANDS = {
    "sft": "train_sft",
    "rm": "train_rm",
    "dpo": "train_dpo",
    "kto": "train_kto",
    "prm": "train_prm",
    "kd": "train_kd",
    "ppo": "train_ppo",
    "grpo": "train_grpo",
    "rloo": "train_rloo",
    "ppo_ray": "train_ppo_ray",
    "serve_rm": "serve_rm",
    "batch_inference": "batch_inference",
    "lora_combiner": "lora_combiner",
    "import_gguf": "import_gguf",
    "chat": "interactive_chat",
    "make_tiny_model": "make_tiny_model",
    "make_data": "make_data",
    "quickstart": "quickstart",
}


def _available() -> dict[str, str]:
    return {k: v for k, v in COMMANDS.items() if importlib.util.find_spec(f"rlhfkit.cli.{v}") is not None}


def _summary(module: str) -> str:
    """The first line of a command module's docstring, read without importing it (no torch at --help)."""
    import ast

    spec = importlib.util.find_spec(f"rlhfkit.cli.{module}")
    try:
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (OSError, SyntaxError):
        return ""
    return doc.split("\n")[0].split(": `")[0].split(" (")[0].split(", ")[0].rstrip(".")


def usage() -> str:
    lines = ["usage: rlhfkit <command> [--config FILE] [flags]", "",
             "  rlhfkit <command> --help   its flags by group, with defaults",
             "  rlhfkit --version          the rlhfkit version", "",
             "commands (rlhfkit <command> == python -m rlhfkit.cli.<module>):", f"  {'command':<16} {'module':<17} what it does"]
    for k, v in _available().items():
        lines.append(f"  {k:<16} {v:<17} {_summary(v)}")
    return "\n".join(lines)


def flag_reference(modules: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Each command module's (default: all) description and flags by help group (module docstring)."""
    from rlhfkit.config.flag_parser import describe

    out = {}
    for module in modules or list(dict.fromkeys(COMMANDS.values())):
        parser = importlib.import_module(f"rlhfkit.cli.{module}").build_parser()
        out[module] = {"description": parser.description or "", "groups": describe(parser)}
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    if argv[0] in ("-V", "--version"):
        from rlhfkit import __version__

        print(f"rlhfkit {__version__}")
        return
    cmd, rest = argv[0], argv[1:]
    module = COMMANDS.get(cmd) or (cmd if cmd in COMMANDS.values() else None)
    if module is None or module not in _available().values():
        import difflib

        close = difflib.get_close_matches(cmd, list(_available()), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"rlhfkit: unknown command '{cmd}'{hint}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [f"rlhfkit {cmd}", *rest]
    runpy.run_module(f"rlhfkit.cli.{module}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
