"""`FlagParser`: argparse with exact-match flags, dotted aliases, help groups, `--config` files and
conflict checks. The flag table itself (which flags each command has) is in rlhfkit.config.flags.

- Names: a flag is declared once with all of its names; the first is the flat OpenRLHF name and
  gives the `dest`, later ones are aliases (`--pretrain`, `--model.model_name_or_path`, ...).
  Unknown flags fail with the closest valid name (exit code 2).
- Groups: flags are declared inside `with p.group(MODEL): ...` (outside a block: the group of the
  command's own flags, "<prog> options"); `--help` lists them by group with
  each flag's names once, its help line and its default. tests/unit/test_cli_help.py fails on a
  flag without help or outside a group. `describe(parser)` gives the same table as data (the flag
  reference in docs/ is generated from it, see rlhfkit.cli.main.flag_reference).
- Inert flags (`inert="why"`): accepted for OpenRLHF command lines, no effect here; parsing prints
  one note for each one set to a non-default value (rank 0 only under torchrun).
- `--log_level`, `--verbose` (every command): the console's level, and third-party messages (transformers'
  load reports, other packages' warnings and progress bars) on the console too; parsing sets up logging
  (rlhfkit.logs). A command that configures its logging itself (`own_logging=True`, serve_rm) has
  no --verbose, and its --log_level is its own to read.
- `--config FILE` (YAML or JSON, rlhfkit.config.config_file): its values become the defaults, so
  every flag on the command line overrides the file. A run's `run_config.json` is such a file.
- Conflicts (exit code 2, one line naming both flags): two names of one setting given different
  values on one command line (`--bf16 --param_dtype fp32`, `--pretrain a --model.model_name_or_path
  b`, `--muon_nesterov --muon_no_nesterov`), and pairs declared with `p.implies` / `p.exclusive`.
  Repeating the same flag keeps the last value, as argparse does (scripts append overrides).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import logging
import os
import re
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping, Sequence, TypeVar

from rlhfkit import logs
from rlhfkit.config.declare import add_fields, flag
from rlhfkit.logs import LEVELS

log = logging.getLogger(__name__)

# argparse actions whose repeated use is accumulation, not a conflict
_ACCUMULATING = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction,
                 argparse._HelpAction, argparse._VersionAction)
# the help groups of the shared flag table (rlhfkit.config.flags, rl_flags)
GENERAL = "general"
MODEL = "model"
LORA = "LoRA / QLoRA"
DATA = "data"
TRAIN = "training"
OPTIM = "optimizer"
RL_MODELS = "RL: reward, critic and reference models"
RL_REWARD = "RL: reward and agents"
RL_ROLLOUT = "RL: rollout (generation)"
RL_ALGO = "RL: algorithm (advantages, KL, policy loss)"
RL_CRITIC = "RL: critic optimizer"
RL_ASYNC = "RL: async training"
RL_PTX = "RL: PPO-ptx (pretraining loss)"
RL_PLACEMENT = "RL: Ray placement, engines and weight sync"
EVAL = "evaluation"
CKPT = "checkpoints and output"
LOGGING = "logging"
BACKEND = "distributed backend"
# --help lists groups in this order; the command's own group comes after "general", other groups of
# a command (serve_rm's "server", ...) next, in the order they were made
GROUP_ORDER = [MODEL, LORA, DATA, TRAIN, OPTIM, RL_MODELS, RL_REWARD, RL_ROLLOUT, RL_ALGO, RL_CRITIC, RL_ASYNC,
               RL_PTX, RL_PLACEMENT, EVAL, CKPT, LOGGING, BACKEND]


def package_version() -> str:
    from rlhfkit import __version__

    return __version__


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's names once (`--pretrain, --model.model_name_or_path PRETRAIN`), its default after
    the help text unless the text already says it, and the description as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40, width=min(120, _terminal_width()))

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(action.option_strings) + " " + metavar

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (action.option_strings and action.nargs != 0 and d not in (None, argparse.SUPPRESS, "", [])
                and "default" not in text and "%(default)" not in text):
            shown = " ".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
            if isinstance(d, str) and (d != d.strip() or not d.isprintable()):
                shown = repr(d)  # "User: {}\nAssistant: " as written on a command line
            text += f" (default: {shown.replace('%', '%%')})"
        return text


def shell_text(text: str) -> str:
    """A module docstring with its shell line continuations back: Python joined "a \\<newline>    --b"
    into "a     --b" (a run of spaces before a flag inside a line)."""
    return re.sub(r"(?<=\S) ( {3,})(?=--)", lambda m: " \\\n" + m.group(1), text)


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns - 2
    except OSError:
        return 118


@dataclass
class ConsoleFlags:
    """What every command prints on the console."""

    log_level: Literal["debug", "info", "warning", "error"] = flag(
        "info", choices=list(LEVELS),
        help="console messages from this level up (debug: also transformers' info messages and third-party progress "
             "bars); the run directory's train.log gets every level")
    verbose: bool = flag(
        False,
        help="also print third-party messages on the console: transformers' load reports and warnings, other "
             "packages' FutureWarnings and warnings, their progress bars (without it they go to train.log only; "
             "errors always show)")


class FlagParser(argparse.ArgumentParser):
    """argparse with exact-match flags, dotted aliases, help groups, --config and conflict checks."""

    def __init__(self, prog: str, description: str = "", *, config_file: bool = True,
                 own_logging: bool = False) -> None:
        """`own_logging`: the command configures its logging itself (serve_rm: uvicorn's); its
        --log_level is only read by the command (set its default with `set_defaults`), no --verbose."""
        super().__init__(prog=prog, description=shell_text(description), allow_abbrev=False, formatter_class=HelpFormatter,
                         usage="%(prog)s [--config FILE] [flags]  (--help lists every flag by group)")
        self.inert: dict[str, str] = {}  # dest -> why the flag has no effect in this command
        self._optionals.title = GENERAL
        self._groups: dict[str, argparse._ArgumentGroup] = {}
        self._current: argparse._ArgumentGroup | None = None
        self._implies: list[tuple[str, dict[str, Any]]] = []
        self._exclusive: list[tuple[str, str, str]] = []
        self._setup_logging = not own_logging
        self.add_argument("--version", action="version", version=f"rlhfkit {package_version()}",
                          help="print the rlhfkit version and exit")
        self._current = self._optionals  # the general group
        try:
            add_fields(self, ConsoleFlags, ["log_level"] if own_logging else ["log_level", "verbose"], here=True,
                       help={"log_level": "level of the server's log lines on stderr"} if own_logging else {})
        finally:
            self._current = None
        if config_file:
            self.add_argument("--config", type=str, default=None, metavar="FILE",
                              help="YAML or JSON file of flag values (flat or dotted names, nested mappings "
                                   "read as dotted); flags on the command line override it; a run's "
                                   "run_config.json replays that run")

    # ------------------------------------------------------------------ declaring

    @contextlib.contextmanager
    def group(self, title: str, description: str | None = None) -> Iterator[FlagParser]:
        """Flags declared inside the block go to the help group `title` (created on first use)."""
        if title not in self._groups:
            self._groups[title] = self.add_argument_group(title, description)
        outer, self._current = self._current, self._groups[title]
        try:
            yield self
        finally:
            self._current = outer

    def flag(self, *names: str, inert: str | None = None, **kw: Any) -> argparse.Action:
        """Add one flag to the current group. The first name is the flat one; later names are
        aliases. `inert`: the flag is accepted but has no effect in this command, for this reason."""
        if "dest" not in kw:
            kw["dest"] = names[0].lstrip("-").replace(".", "_").replace("-", "_")
        action = (self._current or self._own_group()).add_argument(*names, **kw)
        if inert:
            self._set_inert(action, inert)
        return action

    def _own_group(self) -> argparse._ArgumentGroup:
        """The group of flags declared outside a `group` block: the command's own flags."""
        title = f"{self.prog} options"
        if title not in self._groups:
            self._groups[title] = self.add_argument_group(title)
        return self._groups[title]

    def _set_inert(self, action: argparse.Action, why: str) -> None:
        self.inert[action.dest] = why
        note = f"no effect in {self.prog}: {why}"
        action.help = f"{action.help}; {note}" if action.help else f"accepted for OpenRLHF command lines; {note}"

    def alias(self, option: str, *names: str) -> None:
        """More names for the declared flag `option` (a command's own spellings, e.g. TRL's names in
        `rlhfkit grpo`); they set the same dest, and --help lists them with the flag."""
        action = self._option_string_actions[option]
        for name in names:
            if name in self._option_string_actions:
                raise ValueError(f"{self.prog}: {name} is already a flag")
            action.option_strings = [*action.option_strings, name]
            self._option_string_actions[name] = action

    def mark_inert(self, dest: str, why: str) -> None:
        """Declare an existing flag as having no effect in this command (one note when it is set)."""
        actions = [a for a in self._actions if a.dest == dest and a.option_strings]
        if not actions:
            raise KeyError(f"{self.prog}: no flag with dest {dest!r}")
        for a in actions:
            self._set_inert(a, why)

    def implies(self, option: str, **values: Any) -> None:
        """`option` sets these dests to these values: giving it with another flag that sets one of
        them to something else is a conflict (e.g. --use_icepop with --vllm_is_correction_type tis)."""
        self._implies.append((option, values))

    def exclusive(self, a: str, b: str, why: str) -> None:
        """Flags `a` and `b` must not both be given (`why`: what each would do)."""
        self._exclusive.append((a, b, why))

    def ordered_groups(self) -> list[argparse._ArgumentGroup]:
        """The help groups in the order --help lists them (GROUP_ORDER)."""
        own = f"{self.prog} options"

        def rank(item: tuple[int, argparse._ArgumentGroup]) -> tuple[float, int]:
            i, g = item
            if g.title == GENERAL:
                return (0, i)
            if g.title == own:
                return (1, i)
            return (3 + GROUP_ORDER.index(g.title), i) if g.title in GROUP_ORDER else (2, i)

        return [g for _, g in sorted(enumerate(self._action_groups), key=rank)]

    def format_help(self) -> str:
        saved = self._action_groups
        self._action_groups = self.ordered_groups()
        try:
            return super().format_help()
        finally:
            self._action_groups = saved

    # ------------------------------------------------------------------ looking up

    def option_name(self, dest: str) -> str:
        """The first (flat) spelling of `dest`'s flag, e.g. --max_ckpt_mem."""
        for a in self._actions:
            if a.dest == dest and a.option_strings:
                return a.option_strings[0]
        return "--" + dest

    def inert_notes(self, ns: argparse.Namespace) -> list[str]:
        """One note line per inert flag that `ns` sets to a non-default value."""
        return [f"note: {self.option_name(d)} has no effect: {why}" for d, why in self.inert.items()
                if getattr(ns, d, None) != self.get_default(d)]

    def has_flag(self, name: str) -> bool:
        return name in self._option_string_actions

    def valid_names(self) -> list[str]:
        return [s for s in self._option_string_actions if s.startswith("--")]

    # ------------------------------------------------------------------ parsing

    def parse(self, argv: Sequence[str] | None = None, notes: bool = True) -> argparse.Namespace:
        """Parse `argv` (default: the command line); `notes`: print a note per inert flag set."""
        argv = list(sys.argv[1:] if argv is None else argv)
        from rlhfkit.config import config_file

        path = config_file.config_path(self, argv) if self.has_flag("--config") else None
        saved = config_file.apply(self, path) if path else None
        given: list[tuple[str, argparse.Action, Any]] = []
        self._track(given)
        try:
            ns, unknown = self.parse_known_args(argv)
        finally:
            self._untrack()
            if saved:
                config_file.restore(self, saved)
        flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
        if flags:
            msgs = []
            for f in flags:
                close = difflib.get_close_matches(f, self.valid_names(), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                msgs.append(f"unknown flag {f}{hint}")
            self.error("; ".join(msgs))
        if unknown:
            self.error(f"unexpected arguments: {' '.join(unknown)}")
        self.check_conflicts(given)
        return self._finish(ns, {action.dest for _, action, _ in given} | set(saved["defaults"] if saved else ()),
                            notes)

    def parse_values(self, values: Mapping[str, Any], owner: str, notes: bool = True) -> argparse.Namespace:
        """The namespace `parse` gives for a command line that sets each dest of `values` to its (Python)
        value, built without a command line (the Python API's configs; `owner` names the config in errors):
        the flag's defaults, then each value through its flag's type conversion and choices, then the
        conflict checks, the record of what was given and the inert notes, as `parse` does.

        A value of an on/off flag picks the flag whose constant it is (`use_icepop=True`: --use_icepop);
        ValueError for a value no flag of that dest takes, argparse.ArgumentError (naming the flag) for
        one its type or choices refuse."""
        ns = argparse.Namespace()
        for a in self._actions:  # as argparse: the first flag of a dest gives its default
            if a.option_strings and a.default is not argparse.SUPPRESS and not hasattr(ns, a.dest):
                setattr(ns, a.dest, a.default)
        given = []
        for dest, value in values.items():
            action, value = self._setting(dest, value, owner)
            setattr(ns, dest, value)
            given.append((action.option_strings[0], action, value))
        missing = [a.option_strings[0] for a in self._actions if a.required and a.dest not in values]
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        self.check_conflicts(given)
        return self._finish(ns, set(values), notes)

    def _setting(self, dest: str, value: Any, owner: str) -> tuple[argparse.Action, Any]:
        """The action that sets `dest` to `value`, and the value as the command line would give it."""
        actions = [a for a in self._actions if a.dest == dest and a.option_strings]
        if not actions:
            raise TypeError(f"{owner}.{dest} is not a flag of {self.prog}")
        main = setting_action(actions, dest, value, owner)
        if main.nargs == 0:
            return main, value
        if main.nargs not in (None, "?"):
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if isinstance(main.nargs, int) and len(items) != main.nargs:
                raise argparse.ArgumentError(main, f"expected {main.nargs} arguments, got {items!r}")
            converted = [self._get_value(main, command_token(v)) for v in items]
            for v in converted:
                self._check_value(main, v)
            return main, converted
        converted = self._get_value(main, command_token(value))
        self._check_value(main, converted)
        return main, converted

    def _finish(self, ns: argparse.Namespace, explicit: set[str], notes: bool) -> argparse.Namespace:
        """Record what was given, set up logging, print the inert flags' notes."""
        _remember(ns, explicit)
        if self._setup_logging:
            logs.setup(ns.log_level, new_run=notes,  # notes=False: an API config checking its values
                       verbose=bool(getattr(ns, "verbose", False)))
        if notes and os.environ.get("RANK", "0") == "0":
            for line in self.inert_notes(ns):
                log.info(line)
        return ns

    def _track(self, given: list) -> None:
        """Record (option, action, value) for every flag the command line gives."""
        for a in self._actions:
            if a.option_strings and not isinstance(a, _ACCUMULATING):
                a.__class__ = _tracked(type(a))
                a._given = given  # type: ignore[attr-defined]

    def _untrack(self) -> None:
        for a in self._actions:
            if hasattr(a, "_given"):
                a.__class__ = a.__class__.__mro__[1]
                del a._given

    def check_conflicts(self, given: list[tuple[str, argparse.Action, Any]]) -> None:
        """One error (exit code 2) for the first pair of flags that contradict each other."""
        last: dict[str, tuple[str, argparse.Action, Any]] = {}
        for opt, action, value in given:
            prev = last.get(action.dest)
            if prev and prev[0] != opt and prev[2] != value:
                self.error(f"{_shown(*prev)} and {_shown(opt, action, value)} conflict: both set "
                           f"{self.option_name(action.dest)}; give one of them")
            last[action.dest] = (opt, action, value)
        by_action = {id(action): (opt, action, value) for opt, action, value in given}

        def given_as(option: str) -> tuple[str, argparse.Action, Any] | None:  # under any of its names
            return by_action.get(id(self._option_string_actions[option]))

        for option, values in self._implies:
            if not (use := given_as(option)):
                continue
            for dest, value in values.items():
                other = last.get(dest)
                if other and other[2] != value:
                    self.error(f"{_shown(*use)} and {_shown(*other)} conflict: {use[0]} means "
                               f"{self.option_name(dest)} {value}; give one of them")
        for a, b, why in self._exclusive:
            if (ga := given_as(a)) and (gb := given_as(b)):
                self.error(f"{_shown(*ga)} and {_shown(*gb)} conflict: {why}; give one of them")


_PARSED: dict[int, tuple[weakref.ref, dict[str, Any], set[str]]] = {}


def _remember(ns: argparse.Namespace, explicit: set[str], parsed: dict[str, Any] | None = None) -> None:
    key = id(ns)
    values = copy.deepcopy(vars(ns)) if parsed is None else parsed
    _PARSED[key] = (weakref.ref(ns, lambda _r: _PARSED.pop(key, None)), values, explicit)


N = TypeVar("N", bound=argparse.Namespace)


def derive(ns: argparse.Namespace, cls: type[N]) -> N:
    """A copy of `ns` as a `cls` (an argparse.Namespace subclass) for a command to complete, leaving `ns` as
    parsed. `parsed_values`, `set_explicitly` and `set_as_given` answer for the copy as they do for `ns`, so
    run_config.json records the same `_as_parsed` values whichever of the two it is written from. List, dict
    and set values are copied too: an edit of one in the copy does not reach `ns`."""
    new = cls(**{k: copy.copy(v) if isinstance(v, (list, dict, set)) else v for k, v in vars(ns).items()})
    entry = _PARSED.get(id(ns))
    if entry and entry[0]() is ns:
        _remember(new, set(entry[2]), dict(entry[1]))
    return new


def set_explicitly(ns: argparse.Namespace, dest: str) -> bool:
    """Whether the command line (or its --config file) gave `dest` a value, rather than its default.
    True for a namespace that parse did not make (nothing known: assume it was given)."""
    entry = _PARSED.get(id(ns))
    return True if not (entry and entry[0]() is ns) else dest in entry[2]


def set_as_given(ns: argparse.Namespace, dest: str, value: Any) -> None:
    """Set `dest` as if the command line had given it (the Python API's model and datasets), so
    run_config.json records it as given rather than as resolved from the parsed value."""
    setattr(ns, dest, value)
    entry = _PARSED.get(id(ns))
    if entry and entry[0]() is ns:
        entry[1][dest] = value


def parsed_values(ns: argparse.Namespace) -> dict[str, Any] | None:
    """The values `ns` had when `FlagParser.parse` returned it (before a command filled derived
    defaults into it), or None for a namespace that parse did not make."""
    entry = _PARSED.get(id(ns))
    return entry[1] if entry and entry[0]() is ns else None


_TRACKED: dict[type, type] = {}


def _tracked(cls: type) -> type:
    """A subclass of argparse action class `cls` that records each use in `self._given`."""
    if cls not in _TRACKED:
        def __call__(self, parser, namespace, values, option_string=None):
            cls.__call__(self, parser, namespace, values, option_string)
            self._given.append((option_string, self, getattr(namespace, self.dest, None)))

        _TRACKED[cls] = type(f"Tracked{cls.__name__}", (cls,), {"__call__": __call__})
    return _TRACKED[cls]


def _shown(opt: str, action: argparse.Action, value: Any) -> str:
    if action.nargs == 0:
        return opt
    return f"{opt} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def setting_action(actions: list[argparse.Action], dest: str, value: Any, owner: str) -> argparse.Action:
    """Of `actions` (one dest's flags), the one that sets `dest` to `value`: the on/off action whose constant
    `value` is (store_true / store_false / store_const), else the one that takes values. ValueError naming
    `owner.dest` where none can (an on/off setting given a value, None, several values for one)."""
    for a in actions:
        if a.nargs == 0 and a.const == value and type(a.const) is type(value):
            return a
    main = next((a for a in actions if a.nargs != 0), None)
    if main is None:
        raise ValueError(f"{owner}.{dest} is an on/off setting; got {value!r}")
    if value is None:
        raise ValueError(f"{owner}.{dest} cannot be None (its default is {main.default!r})")
    if main.nargs in (None, "?") and isinstance(value, (list, tuple, dict)):
        raise ValueError(f"{owner}.{dest} takes one value, got {value!r}")
    return main


def command_token(v: Any) -> str:
    """A value as one command-line token (a float exactly, a bool as true / false)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def describe(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """The parser's flags by help group, as data (for a generated flag reference):
    [{"title", "description", "flags": [{"names", "default", "help", "choices", "inert"}]}]."""
    inert = getattr(parser, "inert", {})
    out = []
    groups = parser.ordered_groups() if isinstance(parser, FlagParser) else parser._action_groups
    for g in groups:
        flags = []
        for a in g._group_actions:
            if not a.option_strings or isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                continue
            default = None if a.default is argparse.SUPPRESS else a.default
            flags.append({"names": list(a.option_strings), "dest": a.dest, "default": default,
                          "help": a.help or "", "choices": list(a.choices) if a.choices else None,
                          "takes_value": a.nargs != 0, "inert": a.dest in inert})
        if flags:
            out.append({"title": g.title, "description": g.description or "", "flags": flags})
    return out
