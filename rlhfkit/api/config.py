"""Config dataclasses whose fields are a command's flags: one resolved run config for the API and the CLI.

    @flag_config("train_sft", inputs=("pretrain", "dataset", "eval_dataset"))
    @dataclass(repr=False)
    class SFTConfig(FlagConfig):
        learning_rate: float = FLAG      # declared for IDEs and docs; the default is the flag's
        ...                              # every other flag of train_sft is added as a field too

`flag_config` reads the command's `build_parser()` and gives the class one field per flag dest
(the flat flag names of rlhfkit / OpenRLHF: `learning_rate`, `max_len`, `n_samples_per_prompt`, ...),
each with the parser's own default, so a default can never drift from the CLI's. Fields declared
with `FLAG` get that default too; a subclass may change a default (GRPOConfig's estimator).
The `inputs` dests (model path, dataset files, reward file) are not fields: the trainers take
those as objects.

`to_argv()` writes the fields that differ from the parser's defaults as a command line, and
`to_args()` parses it with the command's own parser: the API and the CLI resolve a run through the
same parser, the same type conversion, choices and notes, and the same `run()` afterwards.
`to_command()` prints the equivalent `python -m rlhfkit.cli.<command> ...` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import shlex
from typing import Any, Callable, Sequence

FLAG: Any = object()  # "the command's default" placeholder for declared fields


def command_parser(command: str) -> Any:
    """The FlagParser of `rlhfkit.cli.<command>` (built anew: parsers are cheap, tests mutate none)."""
    return importlib.import_module(f"rlhfkit.cli.{command}").build_parser()


def _skipped(action: argparse.Action) -> bool:
    return (isinstance(action, (argparse._HelpAction, argparse._VersionAction))
            or action.default is argparse.SUPPRESS or not action.option_strings)


def flag_dests(parser: Any) -> dict[str, list[argparse.Action]]:
    """dest -> the actions that set it (in declaration order)."""
    out: dict[str, list[argparse.Action]] = {}
    for a in parser._actions:
        if not _skipped(a):
            out.setdefault(a.dest, []).append(a)
    return out


def _field_for(default: Any) -> Any:
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d))
    return dataclasses.field(default=default)


def flag_config(command: str, inputs: Sequence[str] = ()) -> Callable[[type], type]:
    """Class decorator: make `cls` a dataclass with one field per flag of `command` (see module doc).
    Apply it to a class that is not yet a dataclass."""

    def wrap(cls: type) -> type:
        parser = command_parser(command)
        dests = flag_dests(parser)
        ann = dict(inspect.get_annotations(cls))
        for name in list(ann):
            if name in inputs or name not in dests:
                if getattr(cls, name, None) is FLAG:
                    raise TypeError(f"{cls.__name__}.{name}: no flag {name!r} in {command}")
                continue
            value = cls.__dict__.get(name, FLAG)
            setattr(cls, name, _field_for(parser.get_default(name) if value is FLAG else value))
        for dest in dests:
            if dest in inputs or dest in ann:
                continue
            ann[dest] = Any
            setattr(cls, dest, _field_for(parser.get_default(dest)))
        cls.__annotations__ = ann
        cls.COMMAND = command
        cls.INPUTS = tuple(inputs)
        return dataclasses.dataclass(repr=False, kw_only=True)(cls)

    return wrap


class FlagConfig:
    """Base of the API configs; subclasses are made by `flag_config`."""

    COMMAND: str = ""
    INPUTS: tuple[str, ...] = ()

    def __repr__(self) -> str:
        """Only the fields set away from the command's defaults."""
        return f"{type(self).__name__}({', '.join(self._changed_items())})"

    def _changed_items(self) -> list[str]:
        parser = command_parser(self.COMMAND)
        return [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != parser.get_default(f.name)]

    def to_argv(self) -> list[str]:
        """The command-line flags that give this config (fields equal to the parser default are left out)."""
        parser = command_parser(self.COMMAND)
        dests = flag_dests(parser)
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), parser.get_default(f.name)
            if f.name not in dests:
                raise TypeError(f"{type(self).__name__}.{f.name} is not a flag of {self.COMMAND}")
            if value == default and type(value) is type(default):
                continue
            argv += _render(f.name, value, dests[f.name], type(self).__name__)
        return argv

    def to_args(self, parser: Any = None) -> argparse.Namespace:
        """Parse `to_argv()` with the command's parser: the namespace its CLI would build. A bad value
        (type, choices) raises ValueError naming the flag."""
        parser = parser or command_parser(self.COMMAND)
        parser.exit_on_error = False
        try:
            return parser.parse(self.to_argv())
        except argparse.ArgumentError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from None

    def to_command(self, **inputs: str) -> str:
        """`python -m rlhfkit.cli.<command> ...` for this config; `inputs` give the input flags
        (e.g. pretrain="ckpt/sft", dataset="data/train.jsonl")."""
        parser = command_parser(self.COMMAND)
        dests = flag_dests(parser)
        extra = [t for k, v in inputs.items() for t in _render(k, v, dests[k], type(self).__name__)]
        return shlex.join(["python", "-m", f"rlhfkit.cli.{self.COMMAND}", *extra, *self.to_argv()])


def _render(dest: str, value: Any, actions: list[argparse.Action], owner: str) -> list[str]:
    """The flag tokens that set `dest` to `value`."""
    for a in actions:  # store_true / store_false / store_const: the action whose constant it is
        if a.nargs == 0 and a.const == value and type(a.const) is type(value):
            return [a.option_strings[0]]
    main = next((a for a in actions if a.nargs != 0), None)
    if main is None:
        raise ValueError(f"{owner}.{dest} is an on/off setting; got {value!r}")
    if value is None:
        raise ValueError(f"{owner}.{dest} cannot be None (its default is {main.default!r})")
    if main.nargs not in (None, "?"):
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        return [main.option_strings[0], *(_token(v) for v in items)]
    if isinstance(value, (list, tuple, dict)):
        raise ValueError(f"{owner}.{dest} takes one value, got {value!r}")
    return [f"{main.option_strings[0]}={_token(value)}"]


def _token(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)
