"""The API configs' fields, inherited from the flag declarations, are their commands' flags with the commands'
defaults and types, and the configs behave as the command line does: unknown names get the closest field,
TRL's names for the same settings are taken, and a bad value fails at construction naming the flag."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from rlhfkit import DPOConfig, GRPOConfig, KTOConfig, PPOConfig, RewardConfig, RLOOConfig, SFTConfig
from rlhfkit.api.config import command_parser, flag_dests
from rlhfkit.config.declare import names_of, spec_of

CONFIGS = [SFTConfig, RewardConfig, DPOConfig, KTOConfig, PPOConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_fields_are_the_flags_with_their_defaults_types_and_help(cls):
    parser = command_parser(cls.COMMAND)
    dests = flag_dests(parser)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) == set(dests) - set(cls.INPUTS) - {"config"}
    types = typing.get_type_hints(cls)
    hints = {k: str(v) for k, v in types.items()}
    for name, f in fields.items():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert default == parser.get_default(name), name
        main = next((a for a in dests[name] if a.nargs != 0), None)
        want = "bool" if main is None else {int: "int", float: "float", str: "str"}[main.type]
        if main is not None and main.choices:
            want = "Literal"
        assert want in hints[name], (name, hints[name])
        if main is not None and main.default is None:
            assert type(None) in typing.get_args(types[name]), name


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_is_a_declared_flag_with_its_help(cls):
    """Each field is the declaration of its flag (names and help as metadata), inherited, and the command's
    parser has those names for it; an overridden default keeps the declaration's metadata."""
    parser = command_parser(cls.COMMAND)
    for f in dataclasses.fields(cls):
        spec = next((spec_of(d) for k in type.mro(cls) if (d := getattr(k, "__dataclass_fields__", {}).get(f.name))
                     is not None and spec_of(d) is not None), None)
        assert spec is not None and (spec.help or spec.inert), (cls.__name__, f.name)
        declared = next(d for k in reversed(type.mro(cls)) if (d := getattr(k, "__dataclass_fields__", {}).get(f.name))
                        is not None and spec_of(d) is not None)
        given = {s for a in parser._actions if a.dest == f.name for s in a.option_strings}
        assert given <= set(names_of(declared)) | {"--train_split"}, (cls.__name__, f.name, given)


def test_variant_defaults_keep_the_field_types():
    base = typing.get_type_hints(PPOConfig)
    for cls in (GRPOConfig, RLOOConfig):
        own = typing.get_type_hints(cls)
        for name in inspect.get_annotations(cls):
            assert own[name] == base[name], (cls.__name__, name)
    assert GRPOConfig().to_args().advantage_estimator == "group_norm"


def test_misspelt_and_trl_names():
    with pytest.raises(TypeError, match=r"SFTConfig has no field 'learning_rat' \(did you mean 'learning_rate'\?\)"):
        SFTConfig(learning_rat=1e-3)
    with pytest.raises(TypeError, match=r"GRPOConfig has no field 'beta' \(for TRL's 'beta' see 'init_kl_coef'"):
        GRPOConfig(beta=0.1)
    sft = SFTConfig(output_dir="out/sft", per_device_train_batch_size=4)
    assert (sft.save_path, sft.micro_train_batch_size, sft.output_dir) == ("out/sft", 4, "out/sft")
    g = GRPOConfig(learning_rate=1e-5, num_generations=4, max_completion_length=16, output_dir="o")
    ns = g.to_args()
    assert (ns.actor_learning_rate, ns.n_samples_per_prompt, ns.generate_max_len, ns.save_path) == (1e-5, 4, 16, "o")
    assert g.num_generations == 4 and "learning_rate" not in {f.name for f in dataclasses.fields(g)}
    assert SFTConfig(learning_rate=2e-3).learning_rate == 2e-3  # a field of its own there, not an alias
    with pytest.raises(ValueError, match="output_dir='a' .*save_path='b' both given"):
        SFTConfig(output_dir="a", save_path="b")
    assert dataclasses.replace(g, seed=1).n_samples_per_prompt == 4


def test_bad_values_fail_at_construction_naming_the_flag():
    with pytest.raises(ValueError, match="--advantage_estimator.*invalid choice: 'gpro'"):
        GRPOConfig(advantage_estimator="gpro")
    with pytest.raises(ValueError, match="--n_samples_per_prompt.*invalid int value: '2.5'"):
        GRPOConfig(n_samples_per_prompt=2.5)
    with pytest.raises(ValueError, match="--lr_scheduler.*invalid choice"):
        SFTConfig(lr_scheduler="cosine_restarts")
    with pytest.raises(ValueError, match="use_kl_loss is an on/off setting"):
        PPOConfig(use_kl_loss="yes")
    with pytest.raises(ValueError, match="save_path cannot be None"):
        SFTConfig(save_path=None)


def test_configs_take_keywords_only():
    with pytest.raises(TypeError, match="SFTConfig takes keyword arguments only"):
        SFTConfig(1e-3)


def test_replace_and_copies_keep_working_with_trl_names():
    """dataclasses.replace passes every init-only argument back in, read through its property: that
    read-back never overrides the field the call changes, and a TRL name read from one config can
    set another."""
    base = GRPOConfig(output_dir="a", num_generations=4, learning_rate=1e-5)
    moved = dataclasses.replace(base, save_path="b", n_samples_per_prompt=2)
    assert (moved.save_path, moved.n_samples_per_prompt, moved.actor_learning_rate) == ("b", 2, 1e-5)
    assert dataclasses.replace(base, seed=3).save_path == "a" and type(moved.save_path) is str
    other = SFTConfig(output_dir=base.output_dir, per_device_train_batch_size=base.num_generations)
    assert (other.save_path, other.micro_train_batch_size) == ("a", 4)
    assert type(other.save_path) is str and type(other.micro_train_batch_size) is int
