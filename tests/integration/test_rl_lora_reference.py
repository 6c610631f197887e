"""LoRA RL with a KL term: the reference is the policy with its adapters switched off (no second copy of
the base model), and its log-probs equal a separately loaded base model's."""

from __future__ import annotations

import json

import torch
from helpers import EVEN_REWARD, ppo_flags

from rlhfkit.parallel.dist import init_distributed
from rlhfkit.rl_run import builders as S
from rlhfkit.rl_run.resolve import resolve
from rlhfkit.cli.train_ppo import build_parser
from rlhfkit.types import ExperienceBatch


def _args(model: str, tmp_path, extra: list[str]):
    prompts, reward = tmp_path / "p.jsonl", tmp_path / "r.py"
    prompts.write_text(json.dumps({"input": "1+2="}) + "\n")
    reward.write_text(EVEN_REWARD)
    parsed = build_parser().parse(["--pretrain", model, "--prompt_data", str(prompts), "--remote_rm_url", str(reward),
                                 "--input_key", "input", "--n_samples_per_prompt", "2", "--rollout_batch_size", "1",
                                 "--train_batch_size", "2", "--micro_train_batch_size", "1",
                                 "--micro_rollout_batch_size", "2", "--param_dtype", "fp32", "--device", "cpu",
                                 "--lora_rank", "4", "--lora_alpha", "8", "--init_kl_coef", "0.01",
                                 "--prompt_max_len", "32", "--generate_max_len", "16", "--save_path", str(tmp_path / "out"), *extra])
    return resolve(parsed, 1)


def test_lora_reference_is_the_policy_without_adapters(tiny_model_dir, tmp_path, capsys):
    args = _args(tiny_model_dir, tmp_path, ["--ref_offload"])
    dist = init_distributed("cpu")
    policy, backend = S.build_policy(args, dist, num_steps=4)
    shared = S.build_ref(args, dist, policy_backend=backend)
    separate = S.build_ref(args, dist)  # the old way: the base model loaded again
    out = capsys.readouterr().out
    assert "policy with its LoRA adapters switched off" in out and "--ref_offload has no effect" in out
    assert shared.backend is backend and separate.backend is not backend
    with torch.no_grad():  # trained adapters: B = 0 at init would make the adapters a no-op
        g = torch.Generator().manual_seed(0)
        for name, p in backend.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    ids = torch.randint(3, 60, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    batch = ExperienceBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.clone())
    pol = policy.forward_logprobs(batch)
    ref_shared = shared.forward_logprobs(batch)
    ref_separate = separate.forward_logprobs(batch)
    torch.testing.assert_close(ref_shared, ref_separate, rtol=1e-5, atol=1e-6)
    assert (pol - ref_shared).abs().max() > 1e-2  # the adapters were really off for the reference
    torch.testing.assert_close(policy.forward_logprobs(batch), pol)  # and are on again afterwards


def test_another_reference_model_is_still_loaded(tiny_model_dir, tiny_qwen2_dir, tmp_path):
    args = _args(tiny_model_dir, tmp_path, ["--ref_pretrain", tiny_qwen2_dir])
    dist = init_distributed("cpu")
    _, backend = S.build_policy(args, dist, num_steps=4)
    ref = S.build_ref(args, dist, policy_backend=backend)
    assert ref.backend is not backend and not ref.adapters_off
    assert ref.backend.unwrap().config.model_type == "qwen2"  # the --ref_pretrain model, not the policy


def test_lora_grpo_with_kl_runs_and_syncs_merged_weights(tiny_model_dir, tmp_path):
    """End to end: the builtin engine loads the merged LoRA weights each step (it knows only the base
    model's names; before, the first sync failed on `base_model.model.*`), the KL is computed against
    the adapter-free policy and grows from 0 once the adapters train."""
    from rlhfkit.cli import train_ppo

    prompts, reward = tmp_path / "p.jsonl", tmp_path / "r.py"
    prompts.write_text("".join(json.dumps({"input": f"{i}+{i}="}) + "\n" for i in range(8)))
    reward.write_text(EVEN_REWARD)
    out = tmp_path / "out"
    train_ppo.main(ppo_flags(tiny_model_dir, str(prompts), str(out), reward=str(reward), label_key=None,
                             micro_train_batch_size=4, micro_rollout_batch_size=4, generate_max_len=8, max_steps=2,
                             lora_rank=4, lora_alpha=8, init_kl_coef="0.01", use_kl_loss=True,
                             actor_learning_rate="1e-2", lr_warmup_ratio=0, param_dtype="fp32"))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    kls = [r["train/kl"] for r in rows if "train/kl" in r]
    assert len(kls) == 2 and kls[0] == 0.0 and kls[1] != 0.0
    assert (out / "adapter_model.safetensors").is_file()
