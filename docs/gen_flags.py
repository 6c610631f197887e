"""Write docs/flags/<command>.md, the flag reference of every rlhfkit command, from its parser.

    python docs/gen_flags.py            # rewrite docs/flags/
    python docs/gen_flags.py --check    # exit 1 and name the stale files when they differ

Each command's `build_parser()` is read as argparse sees it: its argument groups in order (one
table per group; a parser without groups gives one table), every flag's names (the first is the
flat OpenRLHF name, the rest its aliases), default, choices and help, and the flags the command
accepts but ignores (`FlagParser.inert`). tests/unit/test_docs_flags.py fails when the committed
files are stale.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "flags")
HEADER = ("Generated from the parser by `python docs/gen_flags.py`; do not edit by hand "
          "(tests/unit/test_docs_flags.py checks that it is up to date).")


def commands() -> dict[str, str]:
    """module -> `rlhfkit` subcommand, for every command that has a parser."""
    from rlhfkit.cli.main import COMMANDS

    out = {}
    for sub, module in COMMANDS.items():
        mod = importlib.import_module(f"rlhfkit.cli.{module}")
        if hasattr(mod, "build_parser"):
            out.setdefault(module, sub)
    return dict(sorted(out.items()))


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def show(value) -> str:
    """A default as a user would type it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(show(v) for v in value)
    if isinstance(value, str):
        return json.dumps(value) if (not value or value != value.strip() or "\n" in value or " " in value) else value
    return str(value)


def default_of(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse._StoreTrueAction):
        return ""  # an alias that sets another flag's value
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    return f"`{cell(show(action.default))}`"


def help_of(parser: argparse.ArgumentParser, action: argparse.Action, inert: dict[str, str]) -> str:
    text = action.help or ""
    if text and text is not argparse.SUPPRESS:
        try:
            # argparse's plain formatter: %(default)s expanded, without the "(default: ...)" that
            # rlhfkit's --help formatter appends (the page has a default column)
            text = argparse.HelpFormatter(parser.prog)._expand_help(action)
        except (KeyError, TypeError, ValueError):
            pass
    else:
        text = ""
    if isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse._StoreTrueAction) \
            and not text:
        text = f"sets `{action.dest}` to `{show(action.const)}`"
    if action.choices and not any(str(c) in text for c in action.choices):
        text = (text + "; " if text else "") + "one of: " + ", ".join(str(c) for c in action.choices)
    if action.required:
        text = "required. " + text
    why = inert.get(action.dest)
    if why and action.option_strings and "no effect in" not in text:  # FlagParser.flag(inert=) says it already
        text = (text + " " if text else "") + f"(no effect in this command: {why})"
    return cell(text)


def groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    out = []
    for g in parser._action_groups:
        acts = [a for a in g._group_actions if not isinstance(a, argparse._HelpAction)]
        if acts:
            title = "options" if g.title == "optional arguments" else g.title  # Python < 3.10's name
            out.append((title or "flags", acts))
    if len(out) > 1 or not out:
        return out
    return [("flags", out[0][1])]


def render(module: str, sub: str) -> str:
    return render_parser(importlib.import_module(f"rlhfkit.cli.{module}").build_parser(), module, sub)


def render_parser(parser: argparse.ArgumentParser, module: str, sub: str) -> str:
    """The markdown page of one parser (`module`: rlhfkit.cli's module name, `sub`: the subcommand)."""
    inert = getattr(parser, "inert", {})
    desc = (parser.description or "").strip().split("\n\n")[0].replace("\n", " ")
    lines = [f"# `{module}` flags", "", HEADER, "", f"`python -m rlhfkit.cli.{module}` or `rlhfkit {sub}`.", ""]
    if desc:
        lines += [desc, ""]
    for title, acts in groups(parser):
        lines += [f"## {title}", "", "| flag | aliases | default | help |", "| --- | --- | --- | --- |"]
        for a in acts:
            if a.option_strings:
                name, aliases = f"`{a.option_strings[0]}`", ", ".join(f"`{s}`" for s in a.option_strings[1:])
            else:
                name, aliases = f"`{a.metavar or a.dest}` (positional)", ""
            lines.append(f"| {name} | {aliases} | {default_of(a)} | {help_of(parser, a, inert)} |")
        lines.append("")
    return "\n".join(lines)


def index(cmds: dict[str, str]) -> str:
    lines = ["# Flag reference", "", HEADER, "", "| command | `rlhfkit` subcommand |", "| --- | --- |"]
    lines += [f"| [{m}]({m}.md) | `rlhfkit {s}` |" for m, s in cmds.items()]
    return "\n".join(lines) + "\n"


def generate() -> dict[str, str]:
    """file name -> content of every file under docs/flags/."""
    cmds = commands()
    files = {f"{m}.md": render(m, s) for m, s in cmds.items()}
    files["README.md"] = index(cmds)
    return files


def stale(files: dict[str, str]) -> list[str]:
    have = set(os.listdir(OUT)) if os.path.isdir(OUT) else set()
    out = [n for n in sorted(have - set(files)) if n.endswith(".md")]
    for name, text in files.items():
        path = os.path.join(OUT, name)
        if not os.path.isfile(path) or open(path).read() != text:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = p.parse_args(argv)
    files = generate()
    if args.check:
        bad = stale(files)
        if bad:
            print("stale flag reference (run python docs/gen_flags.py): " + ", ".join(bad), file=sys.stderr)
            return 1
        return 0
    os.makedirs(OUT, exist_ok=True)
    for name in stale(files):
        path = os.path.join(OUT, name)
        if name in files:
            with open(path, "w") as f:
                f.write(files[name])
        else:
            os.remove(path)
        print(f"wrote {os.path.relpath(path)}" if name in files else f"removed {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))  # this checkout's rlhfkit
    raise SystemExit(main())
