"""Issue 15 part 4 end to end: flags that took no effect now do, or print one note naming them.

train_ppo (GAE, 2 steps, in-process) with --enable_ema --ema_beta 1 (the average never moves, so the
saved model must be the pretrained one while the live policy moved), PPO-ptx (--pretrain_data,
`ptx_loss` logged), --optim muon for the actor and the critic's own --critic.* optimizer flags,
--best_metric_key (one best checkpoint, at the best evaluation), and inert flags (one note each).
train_sft with --optim muon, --save_hf_ckpt --disable_ds_ckpt (snapshots, no resumable checkpoint),
--full_determinism and --use_ds_universal_ckpt.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import even_reward_src
import torch

from rlhfkit.checkpoint.files import load_tensors
from rlhfkit.checkpoint.layout import list_checkpoints
from rlhfkit.backend.muon import MuonWithAdamW
from rlhfkit.cli import train_ppo, train_sft
from rlhfkit.rl_run import builders
from rlhfkit.config import notes
from rlhfkit.tasks.addition import addition_splits
from rlhfkit.trainers.metrics import read_metrics

REWARD_FILE = even_reward_src()  # rewards = scores = the fraction of even characters of each completion


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("flag_effects")
    rows, held = addition_splits(8, 4, seed=2)
    paths = {"prompts": str(d / "prompts.jsonl"), "eval": str(d / "eval.jsonl"), "text": str(d / "text.jsonl"),
             "reward": str(d / "reward.py"), "sft": str(d / "sft.jsonl")}
    for name, data in (("prompts", rows), ("eval", held)):
        with open(paths[name], "w") as f:
            f.writelines(json.dumps({"input": r["input"], "label": r["label"]}) + "\n" for r in data)
    with open(paths["text"], "w") as f:  # pretraining text, in the prompts' --input_key
        f.writelines(json.dumps({"input": f"{i} plus {i + 1} is {2 * i + 1}."}) + "\n" for i in range(12))
    with open(paths["sft"], "w") as f:
        f.writelines(json.dumps({"input": f"{i}+{i}=", "output": str(2 * i)}) + "\n" for i in range(16))
    with open(paths["reward"], "w") as f:
        f.write(REWARD_FILE)
    return paths


def test_ppo_flags_take_effect(tiny_model_dir, files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(notes, "_NOTED", set())
    built = {}
    for name in ("build_policy", "build_critic"):
        real = getattr(builders, name)

        def spy(*a, _real=real, _name=name, **k):
            out = _real(*a, **k)
            built[_name] = out[1]
            return out

        monkeypatch.setattr(builders, name, spy)
    from rlhfkit.models import given, loader

    tokenizer_loads = []

    def counted(path, *a, _real=loader.load_tokenizer, **k):
        tokenizer_loads.append(path)
        return _real(path, *a, **k)

    monkeypatch.setattr(loader, "load_tokenizer", counted)
    monkeypatch.setattr(given, "load_tokenizer", counted)
    save, ckpt = str(tmp_path / "model"), str(tmp_path / "ckpt")
    train_ppo.main([
        "--pretrain", tiny_model_dir, "--remote_rm_url", files["reward"], "--prompt_data", files["prompts"],
        "--input_key", "input", "--label_key", "label", "--advantage_estimator", "gae",
        "--rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "2",
        "--generate_max_len", "6", "--prompt_max_len", "16", "--max_steps", "2", "--init_kl_coef", "0",
        "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--device", "cpu", "--disable_progress",
        "--save_path", save, "--run_dir", str(tmp_path / "run"), "--ckpt_path", ckpt,
        "--enable_ema", "--ema_beta", "1.0", "--pretrain_data", files["text"], "--ptx_coef", "0.5",
        "--optim", "muon", "--critic.adam.betas", "0.8", "0.9", "--critic.max_norm", "0.5",
        "--critic.lr_scheduler", "constant", "--l2", "0.01",
        "--eval_dataset", files["eval"], "--eval_steps", "1", "--eval_n_samples_per_prompt", "2",
        "--best_metric_key", "eval_reward", "--zpg", "2", "--max_ckpt_mem", "10", "--perf",
    ])
    assert tokenizer_loads.count(tiny_model_dir) == 1, tokenizer_loads  # the policy's, once (PPO-ptx reuses it)
    out = capsys.readouterr().out
    for note in ("note: --zpg has no effect", "note: --perf has no effect"):
        assert out.count(note) == 1, (note, out)
    assert "--max_ckpt_mem" not in out
    assert "--param_dtype" not in out  # left at its default: no note that it does nothing on a CPU

    policy, critic = built["build_policy"], built["build_critic"]
    assert policy.cfg.max_ckpt_mem == 10.0 and critic.cfg.max_ckpt_mem == 10.0  # rotation by size (GB)
    assert isinstance(policy.optimizer, MuonWithAdamW) and isinstance(critic.optimizer, torch.optim.AdamW)
    c = critic.optim_cfg
    assert (tuple(c.adam_betas), c.max_norm, c.lr_scheduler, c.l2) == ((0.8, 0.9), 0.5, "constant", 0.01)
    assert policy.optim_cfg.max_norm == 1.0 and tuple(policy.optim_cfg.adam_betas) == (0.9, 0.95)

    # EMA with beta 1 stays at the initial weights: that is what was saved; the live policy moved
    init = load_tensors(os.path.join(tiny_model_dir, "model.safetensors"))
    saved = load_tensors(os.path.join(save, "model.safetensors"))
    live = policy.full_state_dict()
    k = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(saved[k].float(), init[k].float())
    assert not torch.equal(live[k], init[k])

    rows = read_metrics(os.path.join(str(tmp_path / "run"), "metrics.jsonl"))
    trained = [r for r in rows if "train/policy_loss" in r]
    assert len(trained) == 2 and all(r["train/ptx_loss"] > 0 for r in trained)

    # one best checkpoint: the step with the highest eval_reward (the first one on a tie)
    evals = {r["step"]: r["eval/reward"] for r in rows if r["step"] > 0 and "eval/reward" in r}
    best_step = max(sorted(evals), key=lambda s: evals[s])
    found = list_checkpoints(os.path.join(ckpt, "best", "actor"))
    assert [t for _, t in found] == [f"global_step{best_step}"]
    client = json.load(open(os.path.join(ckpt, "best", "actor", f"global_step{best_step}", "client_state.json")))
    assert client["best_metric_key"] == "eval/reward" and client["best_metric_value"] == evals[best_step]
    assert [t for _, t in list_checkpoints(os.path.join(ckpt, "best", "critic"))] == [f"global_step{best_step}"]
    assert not os.path.isdir(os.path.join(ckpt, "actor"))  # --save_steps -1: no periodic checkpoint


def test_sft_flags_take_effect(tiny_model_dir, files, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    try:
        run = train_sft.run(train_sft.build_parser().parse([
            "--pretrain", tiny_model_dir, "--dataset", files["sft"], "--input_key", "input", "--output_key", "output",
            "--max_len", "32", "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_steps", "2",
            "--save_path", str(tmp_path / "model"), "--ckpt_path", ckpt, "--disable_progress",
            "--optim", "muon", "--muon.lr", "0.01", "--muon.no_nesterov", "--save_steps", "1", "--save_hf_ckpt",
            "--disable_ds_ckpt", "--full_determinism", "--use_ds_universal_ckpt", "--dataloader_num_workers", "2"]))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    opt = run.backend.optimizer
    assert isinstance(opt, MuonWithAdamW)
    muon_group = next(g for g in opt.param_groups if g.get("muon"))
    assert muon_group["lr"] == 0.01 or muon_group["initial_lr"] == 0.01
    assert muon_group["nesterov"] is False
    assert sorted(os.listdir(ckpt)) == ["global_step1_hf", "global_step2_hf"]  # HF snapshots only
    assert os.path.isfile(os.path.join(ckpt, "global_step2_hf", "model.safetensors"))
    out = capsys.readouterr().out
    assert out.count("note: --use_universal_ckpt has no effect") == 1, out
    assert out.count("note: --dataloader_num_workers has no effect") == 1, out
