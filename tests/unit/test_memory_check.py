"""train_ppo_ray's flags -> memory plan inputs, the printed table and the refusal (rlhfkit.rl_run.memory_check)."""

from __future__ import annotations

import argparse

import pytest

from rlhfkit.rl_run import memory_check as M
from rlhfkit.rl_run import builders as S
from rlhfkit.rl_run.resolve import resolve
from rlhfkit.cli import train_ppo_ray
from rlhfkit.cli.common import UsageError

GiB = 2**30


def parse(tiny_model_dir, tmp_path, *extra):
    (tmp_path / "r.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    parsed = train_ppo_ray.build_parser().parse([
        "--pretrain", tiny_model_dir, "--prompt_data", str(tmp_path / "p.jsonl"),
        "--remote_rm_url", str(tmp_path / "r.py"), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "16", "--train_batch_size", "64",
        "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "48",
        "--prompt_max_len", "16", "--init_kl_coef", "0.01", "--save_path", str(tmp_path / "s"), *extra])
    return resolve(parsed, 2)


def changed(args, **values) -> argparse.Namespace:
    """The resolved flags `args` with `values` instead (the resolved flags themselves are read-only)."""
    return argparse.Namespace(**{**vars(args), **values})


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


def test_a_local_lora_policy_on_its_base_holds_no_reference_weights(tiny_model_dir, tmp_path):
    """train_ppo's run has a reference role, but under LoRA on the policy's own base it is the policy with
    its adapters off: the plan counts no reference weights; Ray's reference group loads its own."""
    args = parse(tiny_model_dir, tmp_path, "--lora_rank", "4")
    assert S.roles_in_run(args) == ("policy", "ref")
    local = M.memory_inputs(args, {"policy": 1, "ref": 1}, local=True)
    assert [r.name for r in local.roles] == ["policy"]
    assert [r.name for r in M.memory_inputs(args, {"policy": 1, "ref": 1}).roles] == ["policy", "ref"]


def test_table_is_printed_and_an_over_budget_plan_refuses(tiny_model_dir, tmp_path, capsys):
    args = parse(tiny_model_dir, tmp_path)
    M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=80 * GiB)
    out = capsys.readouterr().out
    assert "pool policy: 1 GPU(s) x [policy]" in out and "pool engines: 1 GPU(s) x [engine]" in out
    with pytest.raises(UsageError, match=r"the memory plan needs about 2\.3 GiB per GPU in pool engines .*\(--skip_memory_check runs anyway\)"):
        M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=GiB // 4)
    M.check_memory(changed(args, skip_memory_check=True), {"policy": 1, "ref": 1}, device_bytes=GiB // 4)
    assert "running anyway (--skip_memory_check)" in capsys.readouterr().out


def test_unreadable_config_skips_the_plan_with_a_line(tiny_model_dir, tmp_path, capsys):
    args = changed(parse(tiny_model_dir, tmp_path), ref_pretrain=str(tmp_path / "missing"))
    M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=GiB // 4)
    assert capsys.readouterr().out.startswith("memory plan: skipped (")


def test_the_hint_names_the_largest_power_of_two_of_tokens_that_fits(tiny_model_dir, tmp_path):
    from dataclasses import replace

    from rlhfkit.distributed.memory_plan import larger_train_tokens, plan_memory

    x = M.memory_inputs(parse(tiny_model_dir, tmp_path), {"policy": 1, "ref": 1})
    assert x.train_tokens == 128  # 2 x --max_len 64

    x = replace(x, colocate_all=True)  # one pool: the engine's context and workspace under the policy's

    def peak(t):
        return plan_memory(replace(x, train_tokens=t, forward_tokens=t)).peak

    assert peak(256) < peak(4096) < peak(8192)  # the activations grow with the budget
    fits = int(peak(4096) / 0.85) + 1
    assert larger_train_tokens(x, fits) == 4096
    assert larger_train_tokens(x, int(peak(256) / 0.85) + 1) == 256  # the smallest: twice the present budget
    assert larger_train_tokens(x, int(peak(256) / 0.85) - 1) is None
    assert larger_train_tokens(x, 10**15) == 32768  # capped
    assert (larger_train_tokens(x, fits, fraction=0.5) or 0) < 4096  # a smaller share of the GPU fits less


def test_a_plan_with_room_prints_the_dynamic_batch_hint_once(tiny_model_dir, tmp_path, capsys):
    args = parse(tiny_model_dir, tmp_path)
    M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=80 * GiB)
    hint = [line for line in capsys.readouterr().out.splitlines() if "--use_dynamic_batch" in line]
    assert hint == ["note: training micro-batches hold up to 128 tokens (--micro_train_batch_size 2 x --max_len 64); "
                    "the memory plan fits 32768 a GPU: --use_dynamic_batch --train_max_tokens_per_gpu 32768 trains "
                    "the same step in fewer, larger micro-batches (docs/performance.md)"]
    args = parse(tiny_model_dir, tmp_path, "--use_dynamic_batch", "--train_max_tokens_per_gpu", "256")
    M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=80 * GiB)
    M.check_memory(parse(tiny_model_dir, tmp_path), {"policy": 1, "ref": 1}, device_bytes=None)  # no GPU here
    assert "--use_dynamic_batch" not in capsys.readouterr().out


def test_a_mixture_of_experts_plan_says_it_under_counts(tiny_model_dir, tmp_path, capsys):
    """The plan of a MoE policy counts its experts and says in one line that its peak is not yet a promise."""
    import shutil

    from transformers import AutoConfig, Qwen3MoeConfig

    moe = tmp_path / "moe"
    shutil.copytree(tiny_model_dir, moe)
    dense = AutoConfig.from_pretrained(tiny_model_dir)
    Qwen3MoeConfig(vocab_size=dense.vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                   num_experts_per_tok=2).save_pretrained(moe)
    args = changed(parse(tiny_model_dir, tmp_path), pretrain=str(moe))
    x = M.memory_inputs(args, {"policy": 1, "ref": 1})
    assert x.roles[0].shape.experts == 8 and x.roles[0].shape.num_params() > 8 * 2 * 3 * 64 * 32
    M.check_memory(args, {"policy": 1, "ref": 1}, device_bytes=80 * GiB)
    assert "mixture-of-experts model counts its weights exactly but under-counts its peak" in capsys.readouterr().out
    capsys.readouterr()
    M.check_memory(parse(tiny_model_dir, tmp_path), {"policy": 1, "ref": 1}, device_bytes=80 * GiB)
    assert "mixture-of-experts" not in capsys.readouterr().out
