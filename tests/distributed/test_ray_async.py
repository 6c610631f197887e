"""Async training with colocated engines and partial rollout under train_ppo_ray (issue 15, part 2).

- OpenRLHF's train_reinforce_baseline_ray_agent_async.sh, flags as written (both spellings) but
  for the tiny model / data, one GPU per role, no ring attention and 2 steps: --async_train
  --partial_rollout --colocate_all_models run (one warning line) instead of being refused.
- Colocated async: without sleep flags the engines generate while the roles train (the async run
  on separate actors, bit for bit); with --vllm_enable_sleep --deepspeed_enable_sleep they take
  turns, and every metric and the final weights still equal the separate-actors async run: batch 2
  comes from the initial policy in all three (staleness 1).
- --partial_rollout across a weight update: a two-turn agent whose episodes of batch 2 wait, after
  their first turn, until step 1 is logged (so its weight update has happened: with partial rollout
  the update does not wait for the batch). Their second turns come from the new policy: each such
  trajectory holds tokens of two versions (mixed_version_samples 1, per-token staleness between 0
  and 1, staleness_token_max 1), and --enable_vllm_is_correction (icepop) weights them token by token.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from helpers import read_run as read
from helpers import rl_flags as flags
from test_ray_ppo import SAMPLE_KEYS, TRAIN_KEYS

ray = pytest.importorskip("ray")
from rlhfkit.cli import train_ppo_ray  # noqa: E402

# --dist loadgroup: one worker runs the modules on the local Ray, which starts once, not once a worker
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("local_ray")]

AGENT = '''
import json, os, time
from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor

COUNTER, METRICS, WAIT_FROM = {counter!r}, {metrics!r}, {wait_from!r}


def logged(step):
    if not os.path.exists(METRICS):
        return False
    with open(METRICS) as f:
        return any(json.loads(line)["step"] >= step for line in f if line.strip())


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        with open(COUNTER, "a") as f:  # the episode's index among all episodes of the run
            f.write("x\\n")
        with open(COUNTER) as f:
            self.index = len(f.readlines()) - 1
        return {{"observation": states["observation"]}}

    async def step(self, states, **kwargs):
        self.turn += 1
        if WAIT_FROM is not None and self.turn == 1 and self.index >= WAIT_FROM:
            with open(COUNTER + ".first_turns", "a") as f:  # this episode's first turn is generated
                f.write("x\\n")
            deadline = time.time() + 120
            while not logged(1) and time.time() < deadline:  # step 1 trained and synced its weights
                time.sleep(0.05)
        text = states["action_text"]
        r = sum(ord(c) % 2 == 0 for c in text) / max(len(text), 1)
        done = self.turn >= 2
        return {{"rewards": r if done else 0.0, "scores": r, "environment_feedback": "" if done else "?",
                 "done": done, "extra_logs": {{"turns": float(self.turn)}}}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def write_agent(d: str, name: str, save: str, wait_from: int | None) -> str:
    path = os.path.join(d, f"{name}_agent.py")
    with open(path, "w") as f:
        f.write(AGENT.format(counter=os.path.join(d, f"{name}_episodes.txt"),
                             metrics=os.path.join(save, "metrics.jsonl"), wait_from=wait_from))
    return path


# train_reinforce_baseline_ray_agent_async.sh: model, data, sizes and GPU counts made tiny; the rest as written
def script_flags(model: str, d: str, save: str, agent: str, dotted: bool) -> list[str]:
    flat = ["--pretrain", model, "--load_checkpoint", "--save_path", save, "--ckpt_path", f"{save}/ckpt",
            "--save_hf_ckpt", "--max_ckpt_num", "3", "--save_steps", "10",
            "--agent_func_path", agent, "--prompt_data", os.path.join(d, "script_prompts.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--prompt_max_len", "32", "--generate_max_len", "6",
            "--apply_chat_template", "--packing_samples", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
            "--train_batch_size", "8", "--dynamic_filtering", "--dynamic_filtering_reward_range", "0.0", "1.0",
            "--use_dynamic_batch", "--train_max_tokens_per_gpu", "16192", "--rollout_max_tokens_per_gpu", "32768",
            "--micro_train_batch_size", "1", "--micro_rollout_batch_size", "8", "--max_samples", "128000",
            "--max_epochs", "1", "--num_episodes", "1",
            "--async_train", "--partial_rollout", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1",
            "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
            "--vllm_tensor_parallel_size", "1", "--vllm_gpu_memory_utilization", "0.7", "--colocate_all_models",
            "--vllm_sync_backend", "nccl", "--enforce_eager", "--gradient_checkpointing", "--param_dtype", "bf16",
            "--advantage_estimator", "reinforce_baseline", "--actor_learning_rate", "5e-7",
            "--entropy_loss_coef", "0.0", "--init_kl_coef", "1e-5", "--use_kl_loss", "--kl_estimator", "k2",
            "--enable_vllm_is_correction", "--vllm_is_correction_type", "icepop",
            "--use_tensorboard", f"{save}/runs", "--logging_steps", "1", "--eval_steps", "-1",
            "--max_steps", "2", "--device", "cpu", "--disable_progress"]
    if not dotted:
        return flat
    dots = {"--pretrain": "--actor.model_name_or_path", "--load_checkpoint": "--ckpt.load_enable",
            "--save_path": "--ckpt.output_dir", "--ckpt_path": "--ckpt.path", "--save_hf_ckpt": "--ckpt.save_hf",
            "--max_ckpt_num": "--ckpt.max_num", "--save_steps": "--ckpt.save_steps",
            "--agent_func_path": "--train.agent_func_path", "--prompt_data": "--data.prompt_dataset",
            "--input_key": "--data.input_key", "--label_key": "--data.label_key",
            "--generate_max_len": "--rollout.max_new_tokens", "--apply_chat_template": "--data.apply_chat_template",
            "--packing_samples": "--ds.packing_samples", "--rollout_batch_size": "--rollout.batch_size",
            "--n_samples_per_prompt": "--rollout.n_samples_per_prompt", "--train_batch_size": "--train.batch_size",
            "--dynamic_filtering": "--algo.dynamic_filtering_enable",
            "--dynamic_filtering_reward_range": "--algo.dynamic_filtering_range",
            "--use_dynamic_batch": "--train.dynamic_batch_enable",
            "--train_max_tokens_per_gpu": "--train.max_tokens_per_gpu",
            "--rollout_max_tokens_per_gpu": "--rollout.max_tokens_per_gpu",
            "--micro_train_batch_size": "--train.micro_batch_size",
            "--micro_rollout_batch_size": "--rollout.micro_batch_size", "--max_samples": "--data.max_samples",
            "--max_epochs": "--train.max_epochs", "--num_episodes": "--train.num_episodes",
            "--async_train": "--train.async_enable", "--partial_rollout": "--train.partial_rollout_enable",
            "--ref_num_nodes": "--ref.num_nodes", "--ref_num_gpus_per_node": "--ref.num_gpus_per_node",
            "--actor_num_nodes": "--actor.num_nodes", "--actor_num_gpus_per_node": "--actor.num_gpus_per_node",
            "--vllm_num_engines": "--vllm.num_engines", "--vllm_tensor_parallel_size": "--vllm.tensor_parallel_size",
            "--vllm_gpu_memory_utilization": "--vllm.gpu_memory_utilization",
            "--colocate_all_models": "--train.colocate_all", "--vllm_sync_backend": "--vllm.sync_backend",
            "--enforce_eager": "--vllm.enforce_eager",
            "--gradient_checkpointing": "--actor.gradient_checkpointing_enable",
            "--param_dtype": "--ds.param_dtype", "--advantage_estimator": "--algo.advantage.estimator",
            "--actor_learning_rate": "--actor.adam.lr", "--entropy_loss_coef": "--actor.entropy_coef",
            "--init_kl_coef": "--algo.kl.init_coef", "--use_kl_loss": "--algo.kl.use_loss",
            "--kl_estimator": "--algo.kl.estimator",
            "--enable_vllm_is_correction": "--algo.advantage.is_correction_enable",
            "--vllm_is_correction_type": "--algo.advantage.is_correction_type",
            "--use_tensorboard": "--logger.tensorboard_dir", "--logging_steps": "--logger.logging_steps",
            "--eval_steps": "--eval.steps"}
    return [dots.get(a, a) for a in flat]


@pytest.mark.parametrize("dotted", [False, True], ids=["flat", "dotted"])
def test_agent_async_script_flags_run(tiny_model_dir, data_dir, local_ray, capsys, dotted):
    from rlhfkit.tasks.addition import addition_splits

    rows, _ = addition_splits(8, 2, seed=3)
    with open(os.path.join(data_dir, "script_prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": r["input"], "label": r["label"]}) + "\n" for r in rows)
    save = os.path.join(data_dir, f"script_{dotted}")
    agent = write_agent(data_dir, f"script_{dotted}", save, None)
    train_ppo_ray.main(script_flags(tiny_model_dir, data_dir, save, agent, dotted))
    out = capsys.readouterr().err  # warnings go to stderr
    assert out.count("warning: --async_train with --colocate_all_models") == 1
    recs, _ = read(save)
    assert [r["step"] for r in recs] == [1, 2]
    assert all("train/staleness_token_mean" in r and "train/filter_rounds" in r for r in recs)
    trained = [r for r in recs if not r["train/skipped_steps"]]
    assert trained and all("train/is_dropped_ratio" in r for r in trained)  # icepop ran
    assert os.path.isdir(os.path.join(save, "runs"))


def async_flags(model: str, d: str, save: str, *extra: str) -> list[str]:
    return flags(model, d, save, "--async_train", "--async_queue_size", "1", *extra)


@pytest.fixture(scope="module")
def async_separate(tiny_model_dir, data_dir, local_ray):
    save = os.path.join(data_dir, "async_separate")
    train_ppo_ray.main(async_flags(tiny_model_dir, data_dir, save))
    return read(save)


@pytest.mark.parametrize("sleep", [False, True], ids=["overlap", "turns"])
def test_colocated_async_equals_separate_actors(tiny_model_dir, data_dir, async_separate, capsys, sleep):
    save = os.path.join(data_dir, f"async_colocated_{sleep}")
    extra = ["--vllm_enable_sleep", "--deepspeed_enable_sleep"] if sleep else []
    train_ppo_ray.main(async_flags(tiny_model_dir, data_dir, save, "--colocate_all_models", *extra))
    out = capsys.readouterr().err  # warnings go to stderr
    (warning,) = [line for line in out.splitlines() if line.startswith("warning: --async_train")]
    assert ("take turns" in warning) == sleep and ("generate the next batch while the roles train" in warning) != sleep
    recs, w = read(save)
    ref_recs, ref_w = async_separate
    assert [r["train/staleness"] for r in recs] == [0.0, 1.0] == [r["train/staleness"] for r in ref_recs]
    for a, b in zip(ref_recs, recs, strict=True):
        for k in SAMPLE_KEYS + TRAIN_KEYS + ["train/staleness_token_mean", "train/staleness_token_max"]:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), f"step {a['step']} {k}"
        # the engine's batch layout (test_ray_ppo)
        assert b["train/vllm_kl"] == pytest.approx(a["train/vllm_kl"], abs=1e-6)
    if sleep:  # the engine slept while the roles worked (batch 2 was generated before step 1 trained:
        # it slept once), the states left the device
        assert recs[0]["time/engine_sleep"] > 0 and all(r["time/offload"] > 0 for r in recs)
    for k, v in ref_w.items():
        torch.testing.assert_close(w[k], v, atol=1e-6, rtol=0, msg=k)


def test_partial_rollout_continues_generations_across_a_weight_update(tiny_model_dir, data_dir, local_ray, capsys,
                                                                     monkeypatch):
    from rlhfkit.weightsync import sync as policy_sync

    save = os.path.join(data_dir, "partial")
    rollout_batch, n = 4, 2
    agent = write_agent(data_dir, "partial", save, wait_from=rollout_batch * n)  # batch 2's episodes wait
    # step 1's weight update waits until batch 2's first turns are generated (with version 0): without
    # this the test is a race between step 1's training and batch 2's first turns, which a loaded machine
    # (or a faster step) can lose
    marker = os.path.join(data_dir, "partial_episodes.txt.first_turns")
    real_sync = policy_sync.RayWeightSync.sync

    def first_turns() -> int:
        if not os.path.exists(marker):
            return 0
        with open(marker) as f:
            return len(f.readlines())

    def sync_after_first_turns(self):
        deadline = time.time() + 120
        while time.time() < deadline and first_turns() < rollout_batch * n:
            time.sleep(0.02)
        return real_sync(self)

    monkeypatch.setattr(policy_sync.RayWeightSync, "sync", sync_after_first_turns)
    argv = flags(tiny_model_dir, data_dir, save, "--async_train", "--partial_rollout", "--enable_vllm_is_correction",
                 "--vllm_is_correction_type", "icepop", "--max_len", "64")
    i = argv.index("--remote_rm_url")
    argv[i:i + 2] = ["--agent_func_path", agent]
    train_ppo_ray.main(argv)
    assert "note: --partial_rollout" not in capsys.readouterr().out  # IS correction is on
    recs, _ = read(save)
    first, second = recs
    # batch 1: the initial policy, then trained by it
    assert first["train/staleness_token_max"] == 0.0 and first["train/mixed_version_samples"] == 0.0
    # batch 2: first turns from version 0, second turns (after step 1's update) from version 1
    assert second["train/mixed_version_samples"] == 1.0
    assert second["train/staleness"] == 1.0 and second["train/staleness_token_max"] == 1.0
    assert 0.0 < second["train/staleness_token_mean"] < 1.0
    assert second["train/turns"] == 2.0 and all("train/is_weight" in r and "train/is_dropped_ratio" in r for r in recs)
