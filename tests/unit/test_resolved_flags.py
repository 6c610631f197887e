"""`rlhfkit.rl_run.resolve.resolve` returns a new read-only namespace and leaves the parsed flags as they were;
the copy answers `set_explicitly` and run_config.json's `_as_parsed` as the parsed namespace does
(rlhfkit.config.flag_parser.derive), survives pickling (Ray sends the flags to each actor) and copy.copy."""

from __future__ import annotations

import argparse
import copy
import json
import pickle

import pytest

from rlhfkit.cli import train_ppo
from rlhfkit.config.flag_parser import FlagParser, derive, parsed_values, set_as_given, set_explicitly
from rlhfkit.config.flags import write_resolved_config
from rlhfkit.rl_run.resolve import ResolvedFlags, resolve


@pytest.fixture
def parsed(tiny_model_dir, tmp_path):
    (tmp_path / "r.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    return train_ppo.build_parser().parse([
        "--pretrain", tiny_model_dir, "--prompt_data", str(tmp_path / "p.jsonl"), "--remote_rm_url",
        str(tmp_path / "r.py"), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "2",
        "--max_len", "64", "--clip_eps_low", "0.1", "--adam_betas", "0.8", "0.9", "--device", "cpu",
        "--save_path", str(tmp_path / "s")])


def test_resolve_leaves_the_parsed_flags_and_returns_read_only_ones(parsed):
    before = copy.deepcopy(vars(parsed))
    flags = resolve(parsed, 1)
    assert vars(parsed) == before
    assert isinstance(flags, ResolvedFlags) and flags is not parsed
    assert (parsed.generate_max_len, parsed.critic_adam_betas, parsed.rollout_engine) == (None, None, "auto")
    assert (flags.generate_max_len, flags.critic_adam_betas, flags.rollout_engine) == (64, [0.8, 0.9], "builtin")
    assert flags.eps_clip_low_high == [0.1, flags.eps_clip]
    with pytest.raises(AttributeError, match="resolved flags are read-only: cannot set 'max_len'"):
        flags.max_len = 8
    with pytest.raises(AttributeError, match="read-only: cannot set 'no_such_flag'"):
        flags.no_such_flag = 1
    with pytest.raises(AttributeError, match="read-only: cannot delete 'seed'"):
        del flags.seed
    with pytest.raises(AttributeError, match="read-only: cannot set 'max_len'"):
        setattr(flags, "max_len", 8)
    assert flags.max_len == 64 and "no_such_flag" not in vars(flags)


def test_resolved_flags_answer_as_the_parsed_ones(parsed, tmp_path):
    flags = resolve(parsed, 1)
    assert parsed_values(flags) == parsed_values(parsed)
    for dest in vars(parsed):
        assert set_explicitly(flags, dest) == set_explicitly(parsed, dest), dest
    assert set_explicitly(flags, "max_len") and not set_explicitly(flags, "generate_max_len")
    saved = json.load(open(write_resolved_config(flags, str(tmp_path / "run"))))
    assert saved["_as_parsed"]["generate_max_len"] is None and saved["generate_max_len"] == 64
    assert saved["_as_parsed"]["rollout_engine"] == "auto" and saved["rollout_engine"] == "builtin"
    assert "_frozen" not in saved  # the read-only mark is no flag


def test_resolved_flags_pickle_and_copy_read_only(parsed):
    flags = resolve(parsed, 1)
    for other in (pickle.loads(pickle.dumps(flags)), copy.copy(flags), copy.deepcopy(flags)):
        assert type(other) is ResolvedFlags and other == flags and vars(other) == vars(flags)
        with pytest.raises(AttributeError, match="read-only: cannot set 'seed'"):
            other.seed = 1
    assert argparse.Namespace(**vars(flags)) == flags  # a plain namespace of the same values is equal


def test_derive_registers_the_parsed_entry_for_the_copy():
    p = FlagParser("x")
    p.add_argument("--a", type=int, default=1)
    p.add_argument("--b", type=int, default=2)
    p.add_argument("--c", type=float, nargs=2, default=[0.5, 0.5])
    ns = p.parse(["--a", "5"], notes=False)
    new = derive(ns, argparse.Namespace)
    assert new is not ns and vars(new) == vars(ns)
    assert set_explicitly(new, "a") and not set_explicitly(new, "b")
    new.b = 7
    new.c.append(1.0)  # a list value is the copy's own
    assert parsed_values(new) == parsed_values(ns) == {"a": 5, "b": 2, "c": [0.5, 0.5], "config": None,
                                                       "log_level": "info", "verbose": False}
    assert (ns.b, ns.c) == (2, [0.5, 0.5])
    set_as_given(new, "b", 9)  # given on the copy: recorded for the copy only
    assert parsed_values(new)["b"] == 9 and parsed_values(ns)["b"] == 2
    plain = derive(argparse.Namespace(a=1), argparse.Namespace)  # not from parse: nothing known
    assert parsed_values(plain) is None and set_explicitly(plain, "a")
