"""A pretrained model end to end on CPU: SmolLM2-135M-Instruct (tests/real_model.py; `make real-model`).

- the builtin engine (fp32) decodes the same greedy tokens as transformers' `generate` for 32 new tokens on
  ChatML chat prompts, and ends a turn at `<|im_end|>` (the eos import_gguf gave the tokenizer);
- SFT on a few chat conversations lowers the loss, and the saved model, loaded with AutoModelForCausalLM,
  generates what the trained model in memory generates;
- DPO starts at loss ln 2 (policy = reference) and the loss falls on its second step;
- two GRPO steps (group_norm, a reward_func file grading two-digit sums) run on the builtin engine and save
  a model that differs from the start and generates what the trained policy in memory generates.

All on one xdist worker (one group), each command in-process with tiny batches: the model is 135M parameters.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers import ppo_flags
from real_model import real_model_dir  # noqa: F401 - the session fixture

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real_model")]

IM_END = "<|im_end|>"
SYSTEM = {"role": "system", "content": "Be brief."}  # shorter than the template's default system prompt
CHATS = [  # the first answers at length (32 tokens, no end of turn); the others end their turn sooner
    [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}],
    [{"role": "user", "content": "What is 12+35? Answer with the number only."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello in French."}],
]
ADDITION_REWARD = '''import re


def reward_func(queries, prompts, labels):
    """1 when the last number of the completion is the sum (the label), else half its share of digits (so that
    the samples of a group differ and the update is not skipped for zero advantages)."""
    out = []
    for q, p, label in zip(queries, prompts, labels):
        completion = q[len(p):]
        numbers = re.findall(r"\\d+", completion)
        digits = sum(c.isdigit() for c in completion) / max(len(completion), 1)
        out.append(1.0 if numbers and numbers[-1] == str(label) else 0.5 * digits)
    return {"rewards": out, "scores": out}
'''


@pytest.fixture(autouse=True)
def _remove_saved_models(tmp_path):
    """Each test saves the model in fp32 (540 MB): removed at once, not at the end of the session (make test keeps
    TMPDIR in memory)."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(scope="module")
def hf(real_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval(), tok


def chat_ids(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
                ["input_ids"])


def hf_greedy(model, prompt: list[int], max_new: int = 32) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new)
    return out[0, len(prompt):].tolist()


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_builtin_engine_greedy_equals_transformers_and_stops_at_im_end(hf):
    from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
    from rlhfkit.types import GenerationRequest, SamplingParams

    model, tok = hf
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert (tok.eos_token, tok.pad_token, model.generation_config.eos_token_id) == (IM_END, IM_END, im_end)
    engine = BuiltinEngine(model, tok, device="cpu", config=BuiltinEngineConfig(max_num_seqs=4, max_model_len=256))
    try:
        assert set(engine.eos_token_ids) == {im_end}
        prompts = [chat_ids(tok, c) for c in CHATS]
        outs = engine.generate([GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=32), i)
                                for i, p in enumerate(prompts)])
    finally:
        engine.close()
    reasons = []
    for p, (c,) in zip(prompts, outs):
        ref = hf_greedy(model, p)
        assert c.token_ids == ref, (tok.decode(c.token_ids), tok.decode(ref))
        assert c.finish_reason == ("stop" if ref[-1] == im_end else "length")
        assert im_end not in c.token_ids[:-1]
        reasons.append(c.finish_reason)
    assert reasons == ["length", "stop", "stop"]


def test_sft_lowers_the_loss_and_the_saved_model_generates_the_same(hf, real_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from rlhfkit.cli import train_sft

    model, tok = hf
    rows = [{"messages": [SYSTEM, {"role": "user", "content": "What is 41+27? Answer with the number only."},
                          {"role": "assistant", "content": "68"}]}]
    out = str(tmp_path / "sft")
    args = train_sft.build_parser().parse([
        "--pretrain", real_model_dir, "--dataset", write_jsonl(tmp_path / "chat.jsonl", rows),
        "--input_key", "messages", "--apply_chat_template", "--max_len", "96", "--train_batch_size", "1",
        "--micro_train_batch_size", "1", "--max_epochs", "2", "--learning_rate", "2e-5", "--lr_warmup_ratio", "0",
        "--param_dtype", "fp32", "--save_path", out, "--disable_progress"])
    losses: list[float] = []
    result = train_sft.run(args, on_step_end=lambda s, m, b: losses.append(m["loss"]))
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[1] < 0.8 * losses[0], losses  # the same conversation again: it got likelier

    trained = result.backend.unwrap().eval()
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = chat_ids(tok, CHATS[1])
    assert hf_greedy(saved, prompt) == hf_greedy(trained, prompt)
    before = dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(dict(saved.named_parameters())["model.layers.0.mlp.down_proj.weight"], before)


def test_dpo_starts_at_ln2_and_the_loss_falls(real_model_dir, tmp_path):  # noqa: F811
    from rlhfkit.cli import train_dpo

    user = {"role": "user", "content": "What is 12+35? Answer with the number only."}
    rows = [{"chosen": [SYSTEM, user, {"role": "assistant", "content": "47"}],
             "rejected": [SYSTEM, user, {"role": "assistant", "content": "57"}]}]
    args = train_dpo.build_parser().parse([
        "--pretrain", real_model_dir, "--dataset", write_jsonl(tmp_path / "pairs.jsonl", rows),
        "--apply_chat_template", "--max_len", "96", "--train_batch_size", "1", "--micro_train_batch_size", "1",
        "--max_epochs", "2", "--learning_rate", "2e-5", "--lr_warmup_ratio", "0", "--beta", "0.1",
        "--param_dtype", "fp32", "--save_path", str(tmp_path / "dpo"), "--disable_progress"])
    history = train_dpo.run(args).state.history
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert len(losses) == 2
    assert abs(losses[0] - math.log(2)) < 1e-3, losses  # policy and reference are the same model at step 1
    assert losses[1] < losses[0] - 1e-3, losses


def test_grpo_two_steps_save_a_model_that_generates_as_the_trained_one(hf, real_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from rlhfkit.cli import train_ppo

    model, tok = hf
    rows = [{"input": [SYSTEM, {"role": "user", "content": f"What is {a}+{b}? Answer with the number only."}],
             "label": str(a + b)} for a, b in ((12, 35), (41, 27))]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    reward = tmp_path / "reward.py"
    reward.write_text(ADDITION_REWARD)
    out = str(tmp_path / "grpo")
    parser = train_ppo.build_parser()
    args = parser.parse(ppo_flags(
        real_model_dir, prompts, out, "--apply_chat_template", "--run_dir", str(tmp_path / "run"), reward=str(reward),
        n_samples_per_prompt=2, rollout_batch_size=1, train_batch_size=2, micro_train_batch_size=2,
        generate_max_len=8, prompt_max_len=96, max_steps=2, init_kl_coef=0, actor_learning_rate="1e-5",
        lr_warmup_ratio=0, temperature="1.0", param_dtype="fp32", rollout_engine="builtin"))
    result = train_ppo.run(args, parser)
    steps = [h for h in result.state.history if "train/reward" in h]
    assert len(steps) == 2
    assert all(0.0 <= h["train/reward"] <= 1.0 and h["train/response_length"] <= 8 for h in steps)

    trained = result.placement.policy_backend.unwrap().eval()
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = chat_ids(tok, [SYSTEM, {"role": "user", "content": "What is 12+35? Answer with the number only."}])
    assert hf_greedy(saved, prompt) == hf_greedy(trained, prompt)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(saved.named_parameters())[name], dict(model.named_parameters())[name])
