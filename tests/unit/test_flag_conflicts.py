"""Contradictory flags on one command line are refused with one error naming both (exit code 2):
two names of one setting with different values, an on/off pair, and the declared pairs of train_ppo."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import subprocess_env

from rlhfkit.cli import batch_inference, interactive_chat, train_ppo, train_sft


def refused(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, names", [
    (["--bf16", "--param_dtype", "fp32"], ["--bf16", "--param_dtype fp32"]),
    (["--param_dtype", "fp16", "--bf16"], ["--param_dtype fp16", "--bf16"]),
    (["--pretrain", "a", "--model.model_name_or_path", "b"], ["--pretrain a", "--model.model_name_or_path b"]),
    (["--flash_attn", "--attn_implementation", "eager"], ["--flash_attn", "--attn_implementation eager"]),
    (["--muon_nesterov", "--muon_no_nesterov"], ["--muon_nesterov", "--muon_no_nesterov"]),
    (["--adam.lr", "1e-5", "--learning_rate", "2e-5"], ["--adam.lr 1e-05", "--learning_rate 2e-05"]),
])
def test_two_names_of_one_setting_with_different_values(argv, names, capsys):
    line = refused(train_sft.build_parser(), argv, capsys)
    assert line.startswith("train_sft: error: ") and "conflict" in line
    for n in names:
        assert n in line, (n, line)


@pytest.mark.parametrize("argv", [
    ["--bf16", "--param_dtype", "bf16"],
    ["--pretrain", "a", "--model.model_name_or_path", "a"],
    ["--gradient_checkpointing", "--model.gradient_checkpointing_enable"],
])
def test_agreeing_names_are_accepted(argv):
    train_sft.build_parser().parse(argv)


def test_repeating_one_flag_keeps_the_last_value():
    """Scripts append overrides (`$BASE --learning_rate 1e-5`): argparse's rule stays."""
    ns = train_sft.build_parser().parse(["--learning_rate", "1e-5", "--learning_rate", "3e-5"])
    assert ns.learning_rate == 3e-5


@pytest.mark.parametrize("argv, names", [
    (["--use_icepop", "--vllm_is_correction_type", "tis"], ["--use_icepop", "--vllm_is_correction_type tis"]),
    (["--clip_eps_low", "0.1", "--eps_clip_low_high", "0.2", "0.3"], ["--clip_eps_low 0.1",
                                                                     "--eps_clip_low_high 0.2 0.3"]),
    (["--clip_eps_high", "0.3", "--actor.eps_clip_low_high", "0.2", "0.28"],
     ["--clip_eps_high 0.3", "--actor.eps_clip_low_high 0.2 0.28"]),
])
def test_declared_rl_pairs(argv, names, capsys):
    line = refused(train_ppo.build_parser(), argv, capsys)
    for n in names:
        assert n in line, (n, line)


@pytest.mark.parametrize("module", [batch_inference, interactive_chat])
def test_greedy_sampling_with_a_temperature(module, capsys):
    line = refused(module.build_parser(), ["--greedy_sampling", "--temperature", "0.7"], capsys)
    assert line.endswith("--greedy_sampling and --temperature 0.7 conflict: --greedy_sampling means "
                         "--temperature 0.0; give one of them")
    assert module.build_parser().parse(["--greedy_sampling", "--temperature", "0"]).greedy_sampling


def test_rl_pairs_that_agree_are_accepted():
    p = train_ppo.build_parser()
    assert p.parse(["--use_icepop", "--vllm_is_correction_type", "icepop"]).use_icepop
    ns = p.parse(["--clip_eps_low", "0.1", "--clip_eps_high", "0.3"])
    assert (ns.clip_eps_low, ns.clip_eps_high, ns.eps_clip_low_high) == (0.1, 0.3, None)


def test_parsing_twice_with_one_parser():
    """The tracking of given flags is undone after each parse (no leak into the next one)."""
    p = train_sft.build_parser()
    assert p.parse(["--bf16"]).param_dtype == "bf16"
    assert p.parse(["--param_dtype", "fp32"]).param_dtype == "fp32"
    assert all(not hasattr(a, "_given") for a in p._actions)


def test_conflict_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "rlhfkit.cli.train_sft", "--bf16", "--param_dtype", "fp32"],
                       capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("train_sft: error: --bf16 and --param_dtype fp32 conflict: "
                                                 "both set --param_dtype; give one of them")
