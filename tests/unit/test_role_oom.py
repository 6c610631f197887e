"""An out-of-memory inside a role call becomes one line naming the role, the phase and the flag to change
(rlhfkit.roles.memory; the Ray path through distributed.health.describe)."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlhfkit.rl_run import builders as S
from rlhfkit.cli import train_ppo_ray
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.roles.group import LocalGroup
from rlhfkit.roles.handles import PolicyHandle, ReferenceHandle
from rlhfkit.roles.memory import RoleOutOfMemory


class _Role:
    dist = DistInfo()

    def train_on(self, batch, kl_coef=0.0):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore text")

    def forward_logprobs(self, batch, temperature=1.0):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    def other(self):
        raise ValueError("not memory")


def parse(tmp_path, *extra):
    args = train_ppo_ray.build_parser().parse([
        "--pretrain", "m", "--prompt_data", str(tmp_path / "p.jsonl"), "--remote_rm_url", "r.py",
        "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "16",
        "--train_batch_size", "64", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4",
        "--save_path", str(tmp_path / "s"), *extra])
    return args


def test_oom_in_training_names_role_phase_and_flag(tmp_path):
    policy = PolicyHandle(LocalGroup(_Role(), "policy"))
    with pytest.raises(RoleOutOfMemory) as info:
        policy.train_on(None, 0.0)
    err = info.value
    assert (err.role, err.rank, err.method, err.phase) == ("policy", 0, "train_on", "training")
    assert "Tried to allocate 2.00 GiB." in str(err) and "more text" not in str(err)
    line = str(S.explain_oom(parse(tmp_path, "--colocate_all_models"), err))
    assert "\n" not in line
    assert line.startswith("policy rank 0 ran out of GPU memory in training (train_on)")
    assert "lower --micro_train_batch_size 2" in line and "add --gradient_checkpointing" in line
    assert "add --vllm_enable_sleep" in line  # colocated, engine awake while training


def test_dynamic_batches_and_sleep_change_the_advice(tmp_path):
    err = pytest.raises(RoleOutOfMemory, ReferenceHandle(LocalGroup(_Role(), "ref")).forward_logprobs, None, 1.0).value
    args = parse(tmp_path, "--use_dynamic_batch", "--train_max_tokens_per_gpu", "8192", "--colocate_all_models",
                 "--vllm_enable_sleep", "--gradient_checkpointing")
    line = str(S.explain_oom(args, err))
    assert "ref rank 0 ran out of GPU memory in experience making (log-probs)" in line
    assert "lower --rollout_max_tokens_per_gpu 8192" in line and "--vllm_enable_sleep" not in line
    err = pytest.raises(RoleOutOfMemory, PolicyHandle(LocalGroup(_Role(), "policy")).train_on, None, 0.0).value
    line = str(S.explain_oom(args, err))
    assert "lower --train_max_tokens_per_gpu 8192" in line and "gradient_checkpointing" not in line


def test_other_errors_pass_unchanged():
    with pytest.raises(ValueError, match="not memory"):
        LocalGroup(_Role(), "policy").on_every_rank(_Role.other)


def test_the_error_crosses_a_process_boundary_and_ray_keeps_it():
    err = RoleOutOfMemory("critic", 3, "train_on", 70 * 2**30, 80 * 2**30, "CUDA out of memory.")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.rank == 3 and back.phase == "training"
    assert "70.0 of 80.0 GiB held by this process" in str(back)
    ray_exc = pytest.importorskip("ray.exceptions")
    from rlhfkit.distributed.health import ActorLabel, describe

    task_err = ray_exc.RayTaskError("call", "traceback text", back)
    failure = describe(task_err, ActorLabel("critic", 3))
    assert failure.cause is not None and isinstance(failure.cause, RoleOutOfMemory)
    assert str(failure) == str(err)
