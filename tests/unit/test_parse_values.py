"""`FlagParser.parse_values` (the Python API's configs -> the command's namespace) gives what `parse` gives for
the equivalent command line, through the same conversion, choices and conflict checks, and builds no argv."""

from __future__ import annotations

import argparse

import pytest

from rlhfkit import GRPOConfig, PPOConfig, SFTConfig
from rlhfkit.api.config import command_parser
from rlhfkit.config.flag_parser import FlagParser, set_explicitly

CASES = [
    ("train_sft", {"learning_rate": 3e-4, "adam_betas": [0.8, 0.9], "param_dtype": "fp32", "target_modules": ["q", "v"],
                   "muon_nesterov": False, "max_steps": 5, "input_template": "Q: {}\nA: ", "packing_samples": True},
     ["--learning_rate", "3e-4", "--adam_betas", "0.8", "0.9", "--param_dtype", "fp32", "--target_modules", "q", "v",
      "--muon_no_nesterov", "--max_steps", "5", "--input_template", "Q: {}\nA: ", "--packing_samples"]),
    ("train_ppo", {"advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "use_icepop": True,
                   "eps_clip_low_high": [0.1, 0.3], "critic_lr_scheduler": "constant", "ema_beta": 0.9},
     ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--use_icepop",
      "--eps_clip_low_high", "0.1", "0.3", "--critic_lr_scheduler", "constant", "--ema_beta", "0.9"]),
]


@pytest.mark.parametrize("command,values,argv", CASES, ids=[c[0] for c in CASES])
def test_values_give_the_command_lines_namespace(command, values, argv):
    ns = command_parser(command).parse_values(values, "Cfg", notes=False)
    want = command_parser(command).parse(argv, notes=False)
    assert vars(ns) == vars(want)
    assert all(set_explicitly(ns, d) for d in values) and not set_explicitly(ns, "seed")


def test_errors_are_the_command_lines(capsys):
    p = command_parser("train_ppo")
    p.exit_on_error = False
    with pytest.raises(argparse.ArgumentError,
                       match="--n_samples_per_prompt/--rollout.n_samples_per_prompt: invalid int value: '2.5'"):
        p.parse_values({"n_samples_per_prompt": 2.5}, "Cfg")
    with pytest.raises(argparse.ArgumentError, match="--kl_estimator/--algo.kl.estimator: invalid choice: 'k4'"):
        p.parse_values({"kl_estimator": "k4"}, "Cfg")
    with pytest.raises(argparse.ArgumentError, match="expected 2 arguments"):
        p.parse_values({"reward_clip_range": [1.0]}, "Cfg")
    with pytest.raises(ValueError, match="Cfg.use_kl_loss is an on/off setting; got 'yes'"):
        p.parse_values({"use_kl_loss": "yes"}, "Cfg")
    with pytest.raises(ValueError, match="Cfg.top_k takes one value"):
        p.parse_values({"top_k": [1, 2]}, "Cfg")
    with pytest.raises(TypeError, match="Cfg.lerning_rate is not a flag of train_ppo"):
        p.parse_values({"lerning_rate": 1.0}, "Cfg")
    with pytest.raises(SystemExit):  # as parse: a conflict is the parser's error (exit code 2)
        p.parse_values({"use_icepop": True, "vllm_is_correction_type": "tis"}, "Cfg")
    assert "--use_icepop and --vllm_is_correction_type tis conflict" in capsys.readouterr().err


def test_api_configs_build_no_argv(monkeypatch):
    def no_argv(self, *a, **k):
        raise AssertionError("parsed a command line")

    monkeypatch.setattr(FlagParser, "parse_known_args", no_argv)
    ns = GRPOConfig(n_samples_per_prompt=4, actor_learning_rate=1e-5).to_args(notes=False)
    assert (ns.n_samples_per_prompt, ns.actor_learning_rate, ns.advantage_estimator) == (4, 1e-5, "group_norm")
    assert SFTConfig(max_len=64).to_args(notes=False).max_len == 64
    with pytest.raises(ValueError, match="PPOConfig: argument --advantage_estimator.*invalid choice: 'gpro'"):
        PPOConfig(advantage_estimator="gpro")
