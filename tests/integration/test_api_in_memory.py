"""A model passed to the Python API as an object reaches the run as that object (rlhfkit.models.given):

- GRPO and SFT from a loaded tiny model write no model anywhere but the run's save_path
  (`PreTrainedModel.save_pretrained` fails if called; the final save streams its own files) and give the
  same history, number for number, as the same weights run from a directory. The loaded model's
  `name_or_path` points at a directory holding *other* weights, so a run that loaded anything from there
  would give other numbers.
- the run trains the object itself (no copy): after train() its weights are the saved model's;
  GRPO's reference (KL term) is a frozen copy of the initial weights, so the first step's KL is 0; under
  LoRA no copy is made (the reference is the model with its adapters off) and the numbers are the
  directory run's too.
- DPO and KTO (reference: a frozen copy of the initial weights), the reward model (a head on the given
  backbone) and PPO (reference and critic started from copies; the critic's head drawn as loading it from
  a directory draws it) give the directory's numbers too.
- models given in memory are refused where the run builds its models elsewhere (train_ppo_ray).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from helpers import even_reward_src
from safetensors.torch import load_file

from rlhfkit import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from rlhfkit.tasks.addition import addition_splits

CPU = dict(device="cpu", param_dtype="fp32", disable_progress=True, lr_warmup_ratio=0.0)


def shifted_copy(tiny_model_dir: str, where: str):
    """(the tiny model loaded and changed, its tokenizer); the changed weights are also saved in `where`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(where)
    tok.save_pretrained(where)
    assert model.name_or_path == tiny_model_dir  # what the loaded object says it came from: other weights
    return model, tok


def no_model_writes(monkeypatch) -> None:
    from transformers import PreTrainedModel

    def refuse(self, *a, **k):
        raise AssertionError(f"save_pretrained({a[0] if a else ''}) called on a model given in memory")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", refuse)


CLOCK = ("time/", "train/step_time", "train/generate_share", "train/samples_per_s", "train/tokens_per_s")


def same_numbers(a: list[dict], b: list[dict]) -> None:
    """Same records, keys and values, but for what the clock measures."""
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    compared = 0
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if isinstance(v, float) and not k.startswith(CLOCK):
                assert v == rb[k] or (math.isnan(v) and math.isnan(rb[k])), (k, v, rb[k])
                compared += 1
    assert compared >= 4


def prompts() -> list[dict]:
    rows, _ = addition_splits(4, 0, digits=2, seed=5)
    return [{"input": r["input"], "label": r["label"]} for r in rows]


def test_grpo_from_a_loaded_model_writes_no_model_and_equals_the_directory(tiny_model_dir, tmp_path, monkeypatch):
    model, tok = shifted_copy(tiny_model_dir, str(tmp_path / "shifted"))
    space: dict = {}
    exec(even_reward_src(scores=False), space)
    cfg = GRPOConfig(label_key="label", n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=8,
                     micro_train_batch_size=4, generate_max_len=6, prompt_max_len=16, max_steps=2,
                     actor_learning_rate=1e-3, seed=7, save_path=str(tmp_path / "from_dir"), **CPU)
    h_dir = GRPOTrainer(str(tmp_path / "shifted"), reward_funcs=space["reward_func"], train_dataset=prompts(),
                        args=cfg).train()
    no_model_writes(monkeypatch)
    save = str(tmp_path / "in_memory")
    trainer = GRPOTrainer(model, processing_class=tok, reward_funcs=space["reward_func"], train_dataset=prompts(),
                          args=dataclasses.replace(cfg, save_path=save))
    h_mem = trainer.train()
    assert len(h_mem) == 2
    same_numbers(h_mem, h_dir)
    assert h_mem[0]["train/kl"] == 0.0  # the reference is the policy's initial weights
    assert trainer.model is model  # trained in place, no copy
    saved = load_file(os.path.join(save, "model.safetensors"))
    k = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[k], saved[k])
    assert sorted(os.listdir(tmp_path)) == ["from_dir", "in_memory", "shifted"]


def test_grpo_lora_from_a_loaded_model_makes_no_copy(tiny_model_dir, tmp_path, monkeypatch):
    """Under LoRA the reference is the given model with its adapters off: no copy of it is made."""
    from rlhfkit.models import given

    model, tok = shifted_copy(tiny_model_dir, str(tmp_path / "shifted"))
    space: dict = {}
    exec(even_reward_src(scores=False), space)
    cfg = GRPOConfig(label_key="label", n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=8,
                     micro_train_batch_size=4, generate_max_len=6, prompt_max_len=16, max_steps=2, lora_rank=4,
                     lora_alpha=8, actor_learning_rate=1e-2, seed=7, save_path=str(tmp_path / "from_dir"), **CPU)
    h_dir = GRPOTrainer(str(tmp_path / "shifted"), reward_funcs=space["reward_func"], train_dataset=prompts(),
                        args=cfg).train()

    def no_copy(module):
        raise AssertionError("a copy of the given model was made")

    monkeypatch.setattr(given, "frozen_copy", no_copy)
    trainer = GRPOTrainer(model, processing_class=tok, reward_funcs=space["reward_func"], train_dataset=prompts(),
                          args=dataclasses.replace(cfg, save_path=str(tmp_path / "in_memory")))
    same_numbers(trainer.train(), h_dir)
    assert trainer.model.get_base_model() is model  # the adapters sit in the given module


def test_sft_from_a_loaded_model_writes_no_model_and_equals_the_directory(tiny_model_dir, tmp_path, monkeypatch):
    model, tok = shifted_copy(tiny_model_dir, str(tmp_path / "shifted"))
    rows, _ = addition_splits(16, 0, digits=1, seed=0)
    cfg = SFTConfig(output_key="output", input_template="{}", max_len=32, train_batch_size=8,
                    micro_train_batch_size=4, max_steps=2, learning_rate=1e-3, seed=3,
                    save_path=str(tmp_path / "from_dir"), **CPU)
    h_dir = SFTTrainer(str(tmp_path / "shifted"), train_dataset=rows, args=cfg).train()
    no_model_writes(monkeypatch)
    trainer = SFTTrainer(model, processing_class=tok, train_dataset=rows,
                         args=dataclasses.replace(cfg, save_path=str(tmp_path / "in_memory")))
    h_mem = trainer.train()
    assert len(h_mem) == 2
    same_numbers(h_mem, h_dir)
    assert trainer.model is model
    assert sorted(os.listdir(tmp_path)) == ["from_dir", "in_memory", "shifted"]


def other_trainer(kind: str, model, tok, save: str):
    """A one-step run of the DPO, KTO, reward-model or PPO (GAE: a critic) trainer on `model`."""
    from rlhfkit import (
        DPOConfig,
        DPOTrainer,
        KTOConfig,
        KTOTrainer,
        PPOConfig,
        PPOTrainer,
        RewardConfig,
        RewardTrainer,
    )

    pairs = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(8)]
    common = dict(input_template="{}", max_len=32, train_batch_size=8, micro_train_batch_size=4, max_steps=1,
                  save_path=save, seed=4, **CPU)
    if kind == "dpo":
        return DPOTrainer(model, processing_class=tok, train_dataset=pairs, args=DPOConfig(prompt_key="prompt", **common))
    if kind == "rm":
        return RewardTrainer(model, processing_class=tok, train_dataset=pairs,
                             args=RewardConfig(prompt_key="prompt", **common))
    if kind == "kto":
        rows = [{"input": f"{a}+1=", "output": str(a + 1 - (a % 2)), "label": a % 2 == 0} for a in range(8)]
        return KTOTrainer(model, processing_class=tok, train_dataset=rows, args=KTOConfig(**common))

    def even(queries, prompts, labels):
        return [sum(ord(ch) % 2 == 0 for ch in q[len(p):]) / 6 for q, p in zip(queries, prompts)]

    return PPOTrainer(model, processing_class=tok, reward_funcs=even, train_dataset=prompts(), args=PPOConfig(
        label_key="label", rollout_batch_size=4, train_batch_size=4, micro_train_batch_size=2, generate_max_len=6,
        prompt_max_len=16, max_steps=2, actor_learning_rate=1e-3, init_kl_coef=0.01, save_path=save, seed=4, **CPU))


@pytest.mark.parametrize("kind", ["dpo", "kto", "rm", "ppo"])
def test_other_trainers_from_a_loaded_model_equal_the_directory(kind, tiny_model_dir, tmp_path, monkeypatch):
    """DPO and KTO (the reference: a frozen copy of the initial weights), the reward model (a value head on
    the given backbone) and PPO (a reference and a critic started from copies) as from the directory."""
    model, tok = shifted_copy(tiny_model_dir, str(tmp_path / "shifted"))
    h_dir = other_trainer(kind, str(tmp_path / "shifted"), None, str(tmp_path / "from_dir")).train()
    no_model_writes(monkeypatch)
    h_mem = other_trainer(kind, model, tok, str(tmp_path / "in_memory")).train()
    same_numbers(h_mem, h_dir)


def test_ray_refuses_models_given_in_memory():
    from rlhfkit.cli.common import UsageError
    from rlhfkit.models.given import GivenModels
    from rlhfkit.rl_run.ray_layout import RayLayout
    from rlhfkit.rl_run.root import RLData, RLPlan

    plan = RLPlan(args=None, roles={"policy": 1}, data=RLData(object(), [], []), num_steps=1,
                  given=GivenModels(tokenizer=object()))
    with pytest.raises(UsageError, match="train_ppo_ray builds its models inside Ray actors"):
        with RayLayout().place(plan):
            pass
