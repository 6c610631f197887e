"""train_ppo_ray's role builders (what each Ray actor runs) get --gradient_checkpointing and
--adam_offload from the pickled flag namespace; --adam_offload on CPU says once that it does nothing."""

from __future__ import annotations

from rlhfkit.config import notes
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.rl_run.resolve import resolve
from rlhfkit.cli import train_ppo_ray
from rlhfkit.rl_run import ray_layout

CPU = DistInfo(device="cpu")


def test_role_builders_get_checkpointing_and_adam_offload(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(notes, "_NOTED", set())
    (tmp_path / "r.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    parsed = train_ppo_ray.build_parser().parse([
        "--pretrain", tiny_model_dir, "--prompt_data", str(tmp_path / "p.jsonl"),
        "--remote_rm_url", str(tmp_path / "r.py"), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8",
        "--micro_train_batch_size", "2", "--generate_max_len", "6", "--prompt_max_len", "16",
        "--init_kl_coef", "0.01", "--device", "cpu", "--save_path", str(tmp_path / "s"),
        "--gradient_checkpointing", "--gradient_checkpointing_use_reentrant", "--adam_offload"])
    args = resolve(parsed, 1)
    _, policy = ray_layout.build_role(args, 5, None, "policy", CPU)
    model = policy.unwrap()
    assert model.is_gradient_checkpointing
    # the loader's choice (reentrant, from the flag) is kept; the backend does not switch it off
    assert all(layer._gradient_checkpointing_func.keywords["use_reentrant"] for layer in model.model.layers)
    assert policy.cfg.adam_offload and not policy.cpu_offload  # no CUDA here: no CPUOffloadPolicy
    _, ref = ray_layout.build_role(args, 5, None, "ref", CPU)
    assert not ref.unwrap().is_gradient_checkpointing and not ref.cpu_offload
    out = capsys.readouterr().out
    assert out.count("note: --adam_offload has no effect on CPU") == 1, out


def test_training_state_sleep_has_all_three_names():
    """--deepspeed_enable_sleep (flat), --ds.enable_sleep (dotted) and --fsdp2_enable_sleep (OpenRLHF's
    FSDP2-era scripts) set the same flag."""
    for name in ("--deepspeed_enable_sleep", "--ds.enable_sleep", "--fsdp2_enable_sleep"):
        assert train_ppo_ray.build_parser().parse([name]).deepspeed_enable_sleep
    assert not train_ppo_ray.build_parser().parse([]).deepspeed_enable_sleep
