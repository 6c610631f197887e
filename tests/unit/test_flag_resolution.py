"""How the RL flags of issue 15 resolve (rlhfkit.rl_run.resolve) and the run-dependent notes.

- the critic's optimizer flags default to the actor's (flat names set both), --critic.* set the critic's alone;
- --best_metric_key: "none", no evaluation, and the automatic key without --save_steps turn it off;
- --ema_beta / --ptx_coef without their switch, --ref_offload without a reference: one note each;
- --use_ms without modelscope is an error naming the flag; on local directories a note;
- --experts_implementation reaches from_pretrained for a mixture-of-experts model, a note for a dense one.
"""

from __future__ import annotations

import sys

import pytest
import torch

from rlhfkit.rl_run import builders as S
from rlhfkit.rl_run.resolve import resolve_optional_terms
from rlhfkit.cli import train_ppo
from rlhfkit.cli.common import UsageError, resolve_modelscope_paths
from rlhfkit.config import notes
from rlhfkit.config.configs import ModelConfig
from rlhfkit.optional import MissingPackageError


def rl_args(tmp_path, *extra: str):
    return train_ppo.build_parser().parse([
        "--pretrain", str(tmp_path), "--prompt_data", "p.jsonl", "--remote_rm_url", "r.py", *extra])


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    monkeypatch.setattr(notes, "_NOTED", set())


def test_critic_optimizer_flags(tmp_path):
    a = rl_args(tmp_path, "--adam_betas", "0.8", "0.99", "--max_norm", "2.0", "--critic.lr_scheduler", "constant",
                "--critic.adam.eps", "1e-6", "--critic.optim", "muon", "--critic.muon.lr", "0.01")
    c = S.critic_optim(a)
    assert c["adam_betas"] == [0.8, 0.99] and c["max_norm"] == 2.0  # flat names: both models
    assert (c["lr_scheduler"], c["adam_eps"], c["optim"], c["muon_lr"]) == ("constant", 1e-6, "muon", 0.01)
    assert (a.lr_scheduler, a.adam_eps, a.optim) == ("cosine_with_min_lr", 1e-8, "adam")  # the actor's stay
    resolve_optional_terms(a)
    assert a.critic_max_norm == 2.0 and a.critic_lr_scheduler == "constant"  # resolved into run_config.json


@pytest.mark.parametrize("extra, expect", [
    ([], None),  # no evaluation
    (["--eval_dataset", "e.jsonl", "--eval_steps", "2"], None),  # automatic key, no checkpoints asked for
    (["--eval_dataset", "e.jsonl", "--eval_steps", "2", "--save_steps", "4"], ""),
    (["--eval_dataset", "e.jsonl", "--eval_steps", "2", "--best_metric_key", "eval_reward"], "eval_reward"),
    (["--eval_dataset", "e.jsonl", "--eval_steps", "2", "--save_steps", "4", "--best_metric_key", "none"], None),
])
def test_best_metric_key(tmp_path, extra, expect):
    assert S.best_metric_key(rl_args(tmp_path, *extra)) == expect


def test_keep_best_saves_improvements_only(tmp_path):
    saved = []

    class Ckpt(S.RLCheckpointer):
        def save(self, root, tag, client, max_keep):
            saved.append((root, tag, client["best_metric_value"], max_keep))

    c = Ckpt(None, best_metric_key="")
    for step, value in ((1, 0.2), (2, 0.5), (3, 0.5), (4, 0.1), (5, 0.7)):
        c.keep_best(str(tmp_path), step, {"eval/reward": 0.0, "eval/pass1": value, "eval/pass4": 1.0}, {"step": step})
    assert [(t, v) for _, t, v, _ in saved] == [("global_step1", 0.2), ("global_step2", 0.5), ("global_step5", 0.7)]
    assert {r for r, *_ in saved} == {str(tmp_path / "best")} and {k for *_, k in saved} == {1}
    with pytest.raises(UsageError, match="--best_metric_key eval_acc .* eval/pass1"):
        Ckpt(None, best_metric_key="eval_acc").keep_best(str(tmp_path), 1, {"eval/pass1": 1.0}, {})


def test_notes_for_switches_without_effect(tmp_path, capsys):
    a = rl_args(tmp_path, "--ema_beta", "0.9", "--ptx_coef", "0.1", "--ref_offload", "--init_kl_coef", "0")
    resolve_optional_terms(a)
    out = capsys.readouterr().out
    for note in ("--ema_beta 0.9 has no effect without --enable_ema", "--ptx_coef 0.1 has no effect without "
                 "--pretrain_data", "--ref_offload has no effect: there is no reference model"):
        assert out.count(note) == 1, (note, out)
    assert a.ema_beta == 0.9 and not S.ptx_active(a)
    with pytest.raises(UsageError, match="--ema_beta"):
        resolve_optional_terms(rl_args(tmp_path, "--enable_ema", "--ema_beta", "1.5"))


def test_use_ms(tmp_path, capsys, monkeypatch):
    a = rl_args(tmp_path, "--use_ms")
    resolve_modelscope_paths(a)  # a local directory: nothing to download
    assert "note: --use_ms has no effect" in capsys.readouterr().out
    a = rl_args(tmp_path, "--use_ms", "--reward_pretrain", "org/some-reward-model")
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed
    with pytest.raises(MissingPackageError, match="--use_ms .*modelscope.*pip install .modelscope."):
        resolve_modelscope_paths(a)


def test_experts_implementation(tmp_path, tiny_model_dir, capsys):
    from rlhfkit.models.loader import load_causal_lm
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    moe = make_tiny_model(str(tmp_path / "moe"), TinyModelSpec(arch="mixtral", hidden_size=32, num_hidden_layers=1,
                                                               num_attention_heads=4, intermediate_size=32))
    m = load_causal_lm(ModelConfig(pretrain=moe, param_dtype="fp32", experts_implementation="eager"))
    assert m.config._experts_implementation == "eager"
    dense = load_causal_lm(ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32", experts_implementation="eager"))
    assert isinstance(dense, torch.nn.Module)
    assert "note: --experts_implementation eager has no effect on" in capsys.readouterr().out


def test_param_dtype_note_on_cpu_only_when_the_flag_was_given(capsys):
    """CPU training computes in fp32: --param_dtype bf16 given on the command line gets one note; the
    default bf16 (the flag not given), or fp32, gets none."""
    from rlhfkit.cli import train_sft
    from rlhfkit.cli.common import note_cpu_dtype
    from rlhfkit.config import notes

    notes._NOTED.clear()
    parse = train_sft.build_parser().parse
    note_cpu_dtype(parse(["--pretrain", "m"]), "cpu")
    note_cpu_dtype(parse(["--pretrain", "m", "--param_dtype", "fp32"]), "cpu")
    note_cpu_dtype(parse(["--pretrain", "m", "--bf16"]), "cuda:0")
    assert "param_dtype" not in capsys.readouterr().out
    note_cpu_dtype(parse(["--pretrain", "m", "--bf16"]), "cpu")
    assert capsys.readouterr().out.count("note: --param_dtype bf16 has no effect on CPU") == 1
