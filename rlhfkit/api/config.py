"""Behaviour of the API configs, whose fields are a command's flags: one resolved run for the API and the CLI.

The fields are the flags' declarations themselves: each config (rlhfkit.api.offline, rlhfkit.api.rl)
is a dataclass that inherits the declaration classes of its command's flags (rlhfkit.config.configs,
rl_flags, offline_flags; see rlhfkit.config.declare), so it has a typed field per flag dest (the flat
names of rlhfkit / OpenRLHF: `learning_rate`, `max_len`, `n_samples_per_prompt`, ...) that editors
complete, with the help line as the field's metadata. A command's own default is a value override in
the config's body (RewardConfig's `max_len: int = 512`; GRPOConfig's estimator), never a second
declaration; tests/unit/test_api_fields.py checks that the fields and defaults are the command's.

    SFTConfig(learning_rat=1e-3)           TypeError: SFTConfig has no field 'learning_rat' (did you mean 'learning_rate'?)
    GRPOConfig(advantage_estimator="gpro") ValueError: ... --advantage_estimator: invalid choice ...
    GRPOConfig(num_generations=8)          TRL's name for n_samples_per_prompt (TRL_NAMES)

A config is checked when it is made: its fields go through the command's parser (`to_args`), so a
bad value fails at construction with the error the command line would give, naming the flag.
`to_args()` builds the namespace from the fields with the command's own parser, without a command
line (`FlagParser.parse_values`): the API and the CLI resolve a run through the same type conversion,
choices, conflict checks and notes, and the same `run()` afterwards. `to_argv()` writes the fields that
differ from the parser's defaults as a command line, and `to_command()` prints the equivalent
`python -m rlhfkit.cli.<command> ...` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import shlex
from dataclasses import InitVar, dataclass
from typing import Any, ClassVar, TypeVar

from rlhfkit.config.flag_parser import command_token, setting_action

T = TypeVar("T")

# Hugging Face TRL's config names that mean the same as one of our flags: accepted by the configs
# that have the flag under its own name only (init-only arguments; reading one reads our field)
TRL_NAMES = {"output_dir": "save_path", "learning_rate": "actor_learning_rate",
             "per_device_train_batch_size": "micro_train_batch_size", "num_generations": "n_samples_per_prompt",
             "max_completion_length": "generate_max_len"}
# TRL names whose meaning differs: named in the error for them, with our closest setting(s)
TRL_HINTS = {"num_train_epochs": ("num_episodes", "max_epochs"), "gradient_accumulation_steps": ("train_batch_size",),
             "max_length": ("max_len",), "max_prompt_length": ("prompt_max_len",), "beta": ("init_kl_coef",),
             "warmup_ratio": ("lr_warmup_ratio",), "lr_scheduler_type": ("lr_scheduler",), "weight_decay": ("l2",),
             "max_grad_norm": ("max_norm",), "logging_dir": ("run_dir",), "report_to": ("use_tensorboard",),
             "bf16": ("param_dtype",), "loss_type": ("ipo", "advantage_estimator")}


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


_READ_BACK: dict[type, type] = {}


def _read_back(value: Any) -> Any:
    """`value` as read through a TRL name: marked (a subclass of its str / int / float type), so that
    `dataclasses.replace`, which passes every init-only argument back in, changes nothing through it."""
    t = type(value)
    if t not in (str, int, float):
        return value
    if t not in _READ_BACK:
        _READ_BACK[t] = type(f"ReadBack{t.__name__.title()}", (t,), {"__slots__": ()})
    return _READ_BACK[t](value)


def trl_names(cls: type[T]) -> type[T]:
    """Class decorator of the API configs: each TRL name declared as an init-only argument
    (`output_dir: InitVar[str | None] = None`, TRLNames) also reads and writes our field."""
    own = {f.name for f in dataclasses.fields(cls)}
    aliases = tuple(n for n in cls.__dataclass_fields__ if n in TRL_NAMES and n not in own)  # type: ignore[attr-defined]
    for name in aliases:
        ours = TRL_NAMES[name]
        setattr(cls, name, property(lambda self, o=ours: _read_back(getattr(self, o)),
                                    lambda self, v, o=ours: setattr(self, o, v), doc=f"TRL's name for `{ours}`"))
    cls.TRL_ALIASES = aliases  # type: ignore[attr-defined]
    return cls


def api_config(cls: type[T]) -> type[T]:
    """Class decorator of the API configs: a keyword dataclass without the generated repr (FlagConfig's
    shows what differs from the command's defaults), with the TRL names of `trl_names`."""
    return trl_names(dataclass(repr=False, kw_only=True)(cls))


@dataclass
class TRLNames:
    """Hugging Face TRL's names of settings every training config has (init-only; reading one reads ours)."""

    output_dir: InitVar[str | None] = None
    per_device_train_batch_size: InitVar[int | None] = None


@dataclass
class TRLRLNames(TRLNames):
    """TRL's names of the RL settings (init-only; reading one reads ours)."""

    learning_rate: InitVar[float | None] = None
    num_generations: InitVar[int | None] = None
    max_completion_length: InitVar[int | None] = None


class FlagConfig:
    """Base of the API configs: the flag declarations they inherit become a command's namespace."""

    COMMAND: ClassVar[str] = ""
    INPUTS: ClassVar[tuple[str, ...]] = ()  # the command's inputs (rlhfkit.config.configs.InputsConfig) it takes
    TRL_ALIASES: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """An unknown field name fails here, with the closest field (or our name for a TRL one)."""
        if args:
            raise TypeError(f"{cls.__name__} takes keyword arguments only")
        known = getattr(cls, "__dataclass_fields__", {})
        for name in kwargs:
            if name not in known:
                raise TypeError(f"{cls.__name__} has no field {name!r}{_suggestion(name, cls)}")
        return super().__new__(cls)

    def __post_init__(self, *trl_values: Any) -> None:
        for name, value in zip(self.TRL_ALIASES, trl_values):
            if value is not None:
                self._take_trl_name(name, value)
        self.to_args(notes=False)  # a bad value fails now, naming the flag

    def _take_trl_name(self, name: str, value: Any) -> None:
        ours = TRL_NAMES[name]
        f = next(f for f in dataclasses.fields(self) if f.name == ours)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        if type(value) in _READ_BACK.values():  # read from a config (dataclasses.replace passes it back)
            if getattr(self, ours) == default:
                setattr(self, ours, type(value).__mro__[1](value))
            return
        if getattr(self, ours) not in (default, value):
            raise ValueError(f"{type(self).__name__}: {name}={value!r} (TRL's name for {ours}) and "
                             f"{ours}={getattr(self, ours)!r} both given; give one")
        setattr(self, ours, value)

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

    def to_args(self, parser: Any = None, notes: bool = True) -> argparse.Namespace:
        """The namespace the command's CLI would build for this config, made from the fields directly
        (`FlagParser.parse_values`, no command line): the fields that differ from the parser's defaults go
        through their flags' type conversion, choices and conflict checks, and count as given. A bad value
        (type, choices) raises ValueError naming the flag. `notes`: print the parser's notes on flags that
        have no effect."""
        parser = parser or command_parser(self.COMMAND)
        parser.exit_on_error = False
        values = {}
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), parser.get_default(f.name)
            if not (value == default and type(value) is type(default)):
                values[f.name] = value
        try:
            return parser.parse_values(values, type(self).__name__, notes=notes)
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
    main = setting_action(actions, dest, value, owner)
    if main.nargs == 0:
        return [main.option_strings[0]]
    if main.nargs not in (None, "?"):
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        return [main.option_strings[0], *(command_token(v) for v in items)]
    return [f"{main.option_strings[0]}={command_token(value)}"]


def _suggestion(name: str, cls: type) -> str:
    fields = [f.name for f in dataclasses.fields(cls)] + list(getattr(cls, "TRL_ALIASES", ()))
    hint = next((h for h in TRL_HINTS.get(name, ()) if h in fields), None)
    if hint:
        return f" (for TRL's {name!r} see {hint!r}; docs/api.md maps TRL's names to ours)"
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
