"""train_ppo_ray's flags -> memory plan inputs, the printed table and the refusal (rlhfkit.cli.memory_check)."""

from __future__ import annotations

import pytest

from rlhfkit.cli import memory_check as M
from rlhfkit.cli import ppo_setup as S
from rlhfkit.cli import train_ppo_ray
from rlhfkit.cli.common import UsageError

GiB = 2**30


def parse(tiny_model_dir, tmp_path, *extra):
    args = train_ppo_ray.build_parser().parse([
        "--pretrain", tiny_model_dir, "--prompt_data", str(tmp_path / "p.jsonl"),
        "--remote_rm_url", str(tmp_path / "r.py"), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "16", "--train_batch_size", "64",
        "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "48",
        "--prompt_max_len", "16", "--init_kl_coef", "0.01", "--save_path", str(tmp_path / "s"), *extra])
    S.resolve_flags(args, 2)
    return args


def test_flags_become_plan_inputs(tiny_model_dir, tmp_path):
    args = parse(tiny_model_dir, tmp_path, "--colocate_all_models", "--vllm_num_engines", "2",
                 "--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "2", "--vllm_enable_sleep",
                 "--deepspeed_enable_sleep", "--adam_offload", "--gradient_checkpointing", "--zero_stage", "3")
    x = M.memory_inputs(args, {"policy": 2, "ref": 2})
    assert [(r.name, r.world) for r in x.roles] == [("policy", 2), ("ref", 2)]
    assert x.roles[0].shape.hidden == 64 and x.roles[0].shape.layers == 2 and x.engine.shape == x.roles[0].shape
    assert x.engine.num_engines == 2 and x.engine.max_num_seqs == 16 // 2 * 4 and x.engine.max_model_len == 64
    assert x.train_tokens == 2 * 64 and x.forward_tokens == 4 * 64  # micro-batch x --max_len (16 + 48)
    assert x.colocate_all and x.engine_sleep and x.train_sleep and x.adam_offload and x.gradient_checkpointing
    assert x.zero_stage == 3 and x.param_bytes == 2


def test_table_is_printed_and_an_over_budget_plan_refuses(tiny_model_dir, tmp_path, capsys):
    args = parse(tiny_model_dir, tmp_path)
    M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=80 * GiB)
    out = capsys.readouterr().out
    assert "pool policy: 1 GPU(s) x [policy]" in out and "pool engines: 1 GPU(s) x [engine]" in out
    with pytest.raises(UsageError, match=r"the memory plan needs about 0\.5 GiB .*\(--skip_memory_check runs anyway\)"):
        M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=GiB // 4)
    args.skip_memory_check = True
    M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=GiB // 4)
    assert "running anyway (--skip_memory_check)" in capsys.readouterr().out


def test_unreadable_config_skips_the_plan_with_a_line(tiny_model_dir, tmp_path, capsys):
    args = parse(tiny_model_dir, tmp_path)
    args.ref_pretrain = str(tmp_path / "missing")
    M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=GiB // 4)
    assert capsys.readouterr().out.startswith("memory plan: skipped (")
