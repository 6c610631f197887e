"""The families beyond Llama (rollout/builtin/model/families.py) in the builtin engine and the trainer, against
transformers, on CPU in fp32.

Each family is a tiny random model from transformers' own config class (rlhfkit.models.tiny keeps what
sets it apart: Gemma 3 local / global layers with an 8-token window and two rope tables, Qwen3-MoE routed
experts and one dense layer, gpt-oss experts with attention sinks and windows, Phi-3 partial rotary,
OLMo 2 / 3 norms after attention and MLP (OLMo 3 with windows)). Its matrices are scaled up so that
greedy decoding has clear winners, and its norms, biases and sinks are perturbed so that they matter.

- the engine's greedy tokens equal transformers' `generate` for 32 new tokens on 8 prompts (prompt plus
  completion cross the windows) and its log-probs are within 1e-4 of transformers' log-softmax;
- the trainer's log-probs (rlhfkit.models.forward, padded and packed batches) equal transformers';
- an MoE engine routes every token to the experts transformers' router picks;
- train_ppo runs 3 GRPO steps on the family with the builtin engine (the engine's log-probs agree with
  the trainer's: train/vllm_kl near 0);
- the trainer's Hugging Face export (FSDP2Backend.save_hf) reloads with `from_pretrained` to equal logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhfkit.models.tiny import TinyModelSpec, build_config, build_tokenizer, make_tiny_model
from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.builtin.model.experts import record_routing, route
from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.types import GenerationRequest, SamplingParams

FAMILIES = ["gemma3_text", "qwen3_moe", "gpt_oss", "phi3", "olmo2", "olmo3"]
MOE = ["qwen3_moe", "gpt_oss"]
NEW = 32


def _spec(arch: str) -> TinyModelSpec:
    return TinyModelSpec(arch=arch, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)


@pytest.fixture(scope="module")
def models() -> dict:
    from transformers import AutoModelForCausalLM

    tok, out = build_tokenizer(), {}
    for arch in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build_config(_spec(arch), len(tok), tok)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name or "sinks" in name:
                    p.add_(torch.randn_like(p) * 0.3)
                elif p.dim() >= 2:
                    p.mul_(3.0)  # peaked distributions: greedy choices far from ties
        out[arch] = model
    return out


def _prompts(vocab: int, lengths=(3, 20, 11, 5, 14, 2, 9, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(6, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 under transformers' forward (fp32)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    return torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, x[0, 1:, None])[:, 0]


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_tokens_and_logprobs_equal_transformers(models, arch):
    model = models[arch]
    spec = ModelSpec.from_hf_config(model.config)
    assert spec.model_type == arch
    engine = BuiltinEngine(model, None, device="cpu",
                           config=BuiltinEngineConfig(max_num_seqs=4, max_model_len=128, sync_every=4))
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW)
    outs = engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(prompts)])
    for p, (c,) in zip(prompts, outs):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW, pad_token_id=0)[0, len(p):].tolist()
        assert c.token_ids == ref, f"{arch}: prompt of {len(p)} tokens"
        want = _hf_logprobs(model, p + ref)[len(p) - 1:]
        torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", FAMILIES)
def test_trainer_logprobs_equal_transformers_padded_and_packed(models, arch):
    from rlhfkit.models.forward import token_logprobs

    model = models[arch]
    seqs = [s + s[::-1] for s in _prompts(model.config.vocab_size, (5, 23, 12))]  # 10..46 tokens: past the window
    want = [_hf_logprobs(model, s) for s in seqs]
    longest = max(map(len, seqs))
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):  # left padding, as the RL batches
        ids[i, longest - len(s):], mask[i, longest - len(s):] = torch.tensor(s), 1
    with torch.no_grad():
        padded = token_logprobs(model, ids, attention_mask=mask)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(padded[i, longest - len(s) + 1:], want[i], rtol=0, atol=1e-4)
    packed_ids = torch.tensor([sum(seqs, [])])
    positions = torch.tensor([[t for s in seqs for t in range(len(s))]])
    with torch.no_grad():
        packed = token_logprobs(model, packed_ids, position_ids=positions)[0]
    start = 0
    for s, w in zip(seqs, want):
        torch.testing.assert_close(packed[start + 1:start + len(s)], w, rtol=0, atol=1e-4)
        start += len(s)


@pytest.mark.parametrize("arch", MOE)
def test_engine_routes_tokens_to_the_experts_transformers_picks(models, arch):
    model = models[arch]
    spec = ModelSpec.from_hf_config(model.config)
    engine = BuiltinEngine(model, None, device="cpu", config=BuiltinEngineConfig(max_num_seqs=4, max_model_len=64))
    prompts = _prompts(model.config.vocab_size, (12, 12, 12, 12))
    with record_routing() as engine_routes:  # one prefill of the 4 prompts; max_new_tokens 1: no decode step
        engine.generate([GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=1), i)
                         for i, p in enumerate(prompts)])
    with torch.no_grad():
        out = model(input_ids=torch.tensor(prompts), output_router_logits=True)
    moe_layers = [i for i, k in enumerate(spec.layer_kinds) if k.moe]
    assert len(out.router_logits) == len(moe_layers) == len(engine_routes) and len(moe_layers) >= 2
    for li, logits, got in zip(moe_layers, out.router_logits, engine_routes):
        _, ids = route(logits, spec.moe)  # [4 * 12, k] in (prompt, position) order
        if li == spec.num_layers - 1:  # the engine's last layer runs each prompt's last position only
            ids = ids.view(4, 12, -1)[:, -1]
        assert torch.equal(got, ids), f"{arch} layer {li}"


@pytest.mark.parametrize("arch", FAMILIES)
def test_three_grpo_steps_on_the_builtin_engine(arch, tmp_path):
    from helpers import ppo_flags, write_rl_data

    from rlhfkit.cli import train_ppo

    path = make_tiny_model(str(tmp_path / "model"), TinyModelSpec(arch=arch, hidden_size=32, num_hidden_layers=2,
                                                                 num_attention_heads=2, max_position_embeddings=256))
    d = write_rl_data(str(tmp_path), num_prompts=8)
    prompts, reward = os.path.join(d, "prompts.jsonl"), os.path.join(d, "reward.py")
    train_ppo.main(ppo_flags(path, prompts, str(tmp_path / "out"), "--run_dir", str(tmp_path / "run"),
                             reward=reward, max_steps=3, init_kl_coef="0.01", use_kl_loss=True,
                             actor_learning_rate="1e-3", lr_warmup_ratio=0, input_template="{}",
                             rollout_engine="builtin"))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(abs(r["train/vllm_kl"]) < 1e-5 for r in recs)  # engine log-probs = the trainer's
    assert all(r["train/grad_norm"] > 0 for r in recs)


@pytest.mark.parametrize("arch", FAMILIES)
def test_hf_export_reloads_with_equal_logits(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.config.configs import BackendConfig, OptimConfig
    from rlhfkit.parallel.dist import DistInfo

    path = make_tiny_model(str(tmp_path / "model"), _spec(arch))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    b = FSDP2Backend(model, BackendConfig(param_dtype="fp32"), OptimConfig(learning_rate=1e-2), 5,
                     DistInfo(device="cpu"))
    ids = torch.randint(6, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = b.model(input_ids=ids).logits.float()
    b.backward(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    b.optimizer_step()
    b.save_hf(str(tmp_path / "hf"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    b.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, b.model(input_ids=ids).logits, rtol=0, atol=0)


def test_dispatch_groups_rows_by_expert_stably():
    from rlhfkit.rollout.builtin.model.experts import dispatch

    ids = torch.tensor([[2, 0], [1, 2], [2, 1], [0, 3]])  # rows (token, k): 2 0 1 2 2 1 0 3
    dest, perm, offsets = dispatch(ids, 5)
    # expert 0: rows 1, 6; expert 1: rows 2, 5; expert 2: rows 0, 3, 4; expert 3: row 7; expert 4: none
    assert perm.tolist() == [1, 6, 2, 5, 0, 3, 4, 7]
    assert offsets.tolist() == [2, 4, 7, 8, 8] and offsets.dtype == torch.int32
    assert torch.equal(dest[perm], torch.arange(8)) and torch.equal(ids.reshape(-1)[perm].sort().values,
                                                                    ids.reshape(-1)[perm])
