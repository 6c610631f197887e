"""Flags declared as typed dataclass fields: each setting is declared once; a command's parser, --help, the
flag reference in docs/flags and the Python API's configs are derived from the declarations.

A declaration class (rlhfkit.config.configs, rl_flags, offline_flags; flag_parser.ConsoleFlags; a command's
own flags beside the component that reads them: rlhfkit.serving.flags.ServerFlags,
rlhfkit.models.tiny_spec.TinyModelSpec, rlhfkit.inference's GenerateFlags and ScoreFlags) declares a few
related settings, each as a field:

    @dataclass
    class ModelFlags:
        param_dtype: Literal["bf16", "fp16", "fp32"] = flag(
            "bf16", "--ds.param_dtype", group=MODEL, help="compute dtype",
            switches=(Switch("--bf16", "bf16", "alias of --param_dtype bf16"),))
        lora_rank: int = flag(0, "--ds.lora.rank", group=LORA, help="rank of LoRA adapters (0: off)")

- Names: the field's name is the flag's dest and gives its flat OpenRLHF name (`--param_dtype`); the
  names after the default are its aliases (the dotted ones). A `Switch` is one more flag without a
  value that sets the same dest to a constant (`--bf16`, `--flash_attn`, `--muon_no_nesterov`).
- Type: the annotation. `bool`: an on switch (store_true); `X | None`: values of type X, default
  None; `list[X]`: several values (`nargs`, default "*"); `Literal[...]`: the choices.
- Group: the help group of the field (`group=`); a field without one goes to the group of the
  class's previous field. A command adding fields inside `with p.group(...)` puts them there.

Classes compose by inheritance: a component config (ModelConfig, OptimConfig, BackendConfig) is its
declaration classes plus the settings it takes from elsewhere, whose defaults it reads with
`default_of(Other, "name")` instead of writing them again; the Python API's configs (rlhfkit.api) are
the declaration classes of their command's flags. A config outside rlhfkit.config (SFTDataConfig,
AdvantageConfig, ServeConfig, ...) takes its defaults the same way; where a command has a default of its
own, one named constant beside the component holds it (PAIRED_MAX_LEN, KTO_BETA, TINY_SEED), read by both
the component and the command's `p.set_defaults`.

`add_fields(p, cls)` adds a class's flags to a `FlagParser`. What a command may change is a value,
never a declaration: which fields it takes and in which order (`only`), their help wording (`help`),
which names it accepts (`names`: a subset of the declared ones; `drop`: alias prefixes it does not
take), that a field has no effect in it (`inert`) or must be given (`required`), the dest it reads
a field under (`dests`); its defaults it sets afterwards with `p.set_defaults(dest=value)`.

tests/unit/test_flags_declared_once.py fails when a flag name is declared twice (by two fields, or by
a field and a parser call); tests/unit/test_flag_defaults_once.py when a dataclass field named like a
flag dest writes a literal default, or a config a command builds has other defaults than its parser.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Collection, ContextManager, Literal, Mapping, Protocol, Sequence, Union


class FlagParser(Protocol):
    """What `add_fields` uses of rlhfkit.config.flag_parser.FlagParser (which declares its own flags,
    --log_level and --verbose, with this module, so this module does not import it)."""

    _current: Any  # the group block flags are being added in, if any

    def group(self, title: str, description: str | None = None) -> ContextManager[Any]: ...

    def flag(self, *names: str, inert: str | None = None, **kw: Any) -> Any: ...


FLAG = "flag"  # the metadata key of a field's FlagSpec


@dataclass(frozen=True)
class Switch:
    """A flag without a value that sets the field to `const` (`--bf16` sets param_dtype "bf16")."""

    names: str | tuple[str, ...]
    const: Any
    help: str

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.names,) if isinstance(self.names, str) else self.names


@dataclass(frozen=True)
class FlagSpec:
    """What a field declares beyond its type and default."""

    aliases: tuple[str, ...]
    help: str
    group: str | None = None
    inert: str | None = None
    nargs: int | str | None = None
    switches: tuple[Switch, ...] = ()
    choices: tuple[Any, ...] | None = None


def flag(default: Any, *aliases: str, help: str, group: str | None = None, inert: str | None = None,
         nargs: int | str | None = None, switches: Sequence[Switch] = (), choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field declaring one flag (see the module docstring); a list default is copied per instance.
    `choices`: the values allowed when they are a table of the code rather than a Literal annotation."""
    spec = FlagSpec(tuple(aliases), help, group, inert, nargs, tuple(switches),
                    None if choices is None else tuple(choices))
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={FLAG: spec})
    return dataclasses.field(default=default, metadata={FLAG: spec})


def spec_of(f: dataclasses.Field) -> FlagSpec | None:
    return f.metadata.get(FLAG)


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` that declare a flag, in declaration order."""
    return [f for f in dataclasses.fields(cls) if spec_of(f) is not None]


def default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def declared_default(cls: type, name: str) -> Any:
    """The default `cls.name` declares (a copy, for a list)."""
    return default(next(f for f in dataclasses.fields(cls) if f.name == name))


def declared_help(cls: type, name: str) -> str:
    spec = spec_of(next(f for f in dataclasses.fields(cls) if f.name == name))
    assert spec is not None, name
    return spec.help


def default_of(cls: type, name: str, convert: Callable[[Any], Any] | None = None) -> Any:
    """A field that takes the default declared by `cls.name` (a config mirroring another's setting);
    `convert`: the field holds `convert(that default)` (a tuple where the flag's value is a list)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if convert is not None:
        return dataclasses.field(default_factory=lambda: convert(default(f)))
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    return dataclasses.field(default=f.default)


def flat_name(f: dataclasses.Field) -> str:
    return "--" + f.name


def names_of(f: dataclasses.Field) -> list[str]:
    """Every name the field declares: the flat one, its aliases, its switches'."""
    spec = spec_of(f)
    assert spec is not None, f.name
    return [flat_name(f), *spec.aliases, *(n for s in spec.switches for n in s.option_strings)]


def argparse_kwargs(cls: type, f: dataclasses.Field) -> dict[str, Any]:
    """type / action / nargs / choices / default of the field's value-taking flag, from its annotation."""
    spec = spec_of(f)
    assert spec is not None
    hint = typing.get_type_hints(cls)[f.name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    kw: dict[str, Any] = {"default": default(f)}
    if hint is bool:
        return {**kw, "action": "store_true"}
    if typing.get_origin(hint) in (list, tuple):
        hint = typing.get_args(hint)[0]
        kw["nargs"] = spec.nargs if spec.nargs is not None else "*"
    if typing.get_origin(hint) is Literal:
        choices = list(typing.get_args(hint))
        kw["choices"] = choices
        hint = type(choices[0])
    if spec.choices is not None:
        kw["choices"] = list(spec.choices)
    if hint not in (int, float, str):
        raise TypeError(f"{cls.__name__}.{f.name}: no flag type for {hint!r} (int, float, str, bool, "
                        "their lists and Literals, each optionally | None)")
    return {**kw, "type": hint}


def add_fields(p: FlagParser, cls: type, only: Sequence[str] | None = None, *, help: Mapping[str, str] = {},
               names: Mapping[str, Sequence[str]] = {}, drop: Sequence[str] = (), inert: Mapping[str, str] = {},
               required: Collection[str] = (), here: bool = False, dests: Mapping[str, str] = {}) -> None:
    """Add the flags of `cls`'s fields (all, or those named in `only`, in that order) to `p`.

    help: the command's wording of a field's help; names: the names (a subset of the declared ones,
    switches included) the command accepts; drop: alias prefixes the command does not accept (e.g.
    "--actor." in a command without actor); inert: fields without effect in the command, with why;
    required: fields the command line must give (their default becomes None); here: the flags go to the
    group block they are added in, or the command's own group, whatever the fields' groups; dests: another
    dest for a field in this command (batch_inference reads --max_new_tokens as max_new_tokens)."""
    fields = {f.name: f for f in flag_fields(cls)}
    unknown = set(only or ()) | set(help) | set(names) | set(inert) | set(required)
    if unknown - set(fields):
        raise KeyError(f"{cls.__name__} declares no flag {sorted(unknown - set(fields))}")
    groups: dict[str, str | None] = {}
    group = None
    for f in fields.values():
        groups[f.name] = group = spec_of(f).group or group  # type: ignore[union-attr]
    for name in (fields if only is None else only):
        keep = names.get(name) or [n for n in names_of(fields[name]) if not n.startswith(tuple(drop))]
        _add(p, cls, fields[name], None if here else groups[name], help.get(name), keep, inert.get(name),
             name in required, dests.get(name, name))


def _add(p: FlagParser, cls: type, f: dataclasses.Field, group: str | None, help: str | None,
         names: Sequence[str], inert: str | None, required: bool, dest: str) -> None:
    spec = spec_of(f)
    assert spec is not None
    declared = names_of(f)
    if set(names) - set(declared):
        raise KeyError(f"{cls.__name__}.{f.name} declares no name {sorted(set(names) - set(declared))}")
    keep = set(names)
    kw = argparse_kwargs(cls, f)
    if required:
        kw.update(required=True, default=None)
    value_names = [n for n in (flat_name(f), *spec.aliases) if n in keep]
    block = p._current is None and group is not None
    with p.group(group) if block else contextlib.nullcontext():  # type: ignore[arg-type]
        p.flag(*value_names, dest=dest, help=help or spec.help, inert=inert or spec.inert, **kw)
        for s in spec.switches:
            if switch_names := [n for n in s.option_strings if n in keep]:
                if s.const is False:  # an off switch: argparse's store_false (its default True, the field's)
                    p.flag(*switch_names, dest=dest, action="store_false", help=s.help)
                else:
                    p.flag(*switch_names, dest=dest, action="store_const", const=s.const, help=s.help)
