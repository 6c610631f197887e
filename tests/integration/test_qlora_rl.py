"""QLoRA RL (--load_in_4bit with --lora_rank): the trainer holds the base in bitsandbytes NF4 and the builtin
engine serves that 4-bit base itself, dequantizing a layer at a time (rlhfkit/rollout/builtin/model/quantized.py).

    engine        a peft LoRA model over a 4-bit tiny Qwen2 (adapters on every linear layer, B not zero): the
                  engine holds the trainer's packed tensors (same storage) and one scratch per projection that
                  every layer names; a layer's scratch after `dequantize_layer` equals bitsandbytes' own
                  dequantization of its q, k, v (gate, up) stacked; greedy tokens equal the argmax of the QLoRA
                  model's own forward and log-probs agree, before and after an in-place change of the adapters
    train_ppo     GRPO with --load_in_4bit, 3 steps: the engine serves the policy's own 4-bit base and adapters,
                  its log-probs agree with the trainer's (train/vllm_kl), the adapters train, and the base's
                  4-bit weights are what was loaded
    resume        a QLoRA run resumed from its step-2 checkpoint ends as the uninterrupted run (adapters bit for
                  bit); the checkpoints hold the adapters and the rest, never the 4-bit base (loaded from --pretrain)
    refusals      --load_in_4bit without --lora_rank, with --engine_weights copy, and in train_ppo_ray
    batch_inference  --load_in_4bit generation: the builtin engine serving the 4-bit module equals the HF engine
    memory plan   the 4-bit base and the engine's one-layer scratch, counted by hand; a QLoRA critic's adapters
    ppo           PPO with GAE and --load_in_4bit: the critic trains adapters over its own 4-bit base
    moe           a tiny Qwen3-MoE: attention in 4 bits, the router and experts (3-D tensors) in bf16, all served
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import rl_flags, write_rl_data

pytest.importorskip("bitsandbytes")

from rlhfkit.cli import train_ppo  # noqa: E402
from rlhfkit.cli.common import UsageError  # noqa: E402
from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig  # noqa: E402
from rlhfkit.types import GenerationRequest, SamplingParams  # noqa: E402

PROMPTS = [[5, 9, 14, 3], [7, 7, 2], [11, 4, 6, 8, 10]]


def _qlora_model(path: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from rlhfkit.models.loader import keep_4bit_layout

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=q,
                                                device_map={"": "cpu"})
    keep_4bit_layout(base)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
            if "lora_" in n:
                p.data = p.data.to(torch.bfloat16)  # the trainer's compute dtype (the engine's)
    return model.eval()


def _check_against_forward(model, engine: BuiltinEngine) -> None:
    """Greedy tokens = the argmax of the model's own forward over prompt + tokens; log-probs agree (bf16)."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=10, min_new_tokens=10, logprobs=True)
    outs = engine.generate([GenerationRequest(p, sp) for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        got = out[0]
        with torch.no_grad():
            lp = model(torch.tensor([prompt + got.token_ids])).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
        assert lp.argmax(-1).tolist() == got.token_ids
        want = lp.gather(1, torch.tensor(got.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(got.logprobs), want, atol=1e-2, rtol=0)


def test_engine_serves_the_4bit_base_it_shares(tiny_qwen2_dir):
    import bitsandbytes.functional as bnb_f

    from rlhfkit.models.loader import is_4bit
    from rlhfkit.rollout.builtin.model.quantized import dequantize_layer

    model = _qlora_model(tiny_qwen2_dir)
    engine = BuiltinEngine(model, device="cpu", dtype=torch.bfloat16, share_weights=True,
                           config=BuiltinEngineConfig(max_num_seqs=4, max_model_len=64))
    layers = engine.model.weights.layers
    four_bit = {n: p for n, p in model.named_parameters() if is_4bit(p)}
    assert len(four_bit) == 7 * len(layers)  # q k v o gate up down of every layer
    held = {p.packed.untyped_storage().data_ptr() for lw in layers for parts in lw.quant.values() for p in parts}
    assert held == {p.untyped_storage().data_ptr() for p in four_bit.values()}  # the trainer's tensors, not copies
    for attr in ("qkv", "o", "gate_up", "down"):  # one scratch per projection, named by every layer
        assert len({getattr(lw, attr).data_ptr() for lw in layers}) == 1
    assert sorted(layers[1].lora) == ["down", "gate_up", "o", "qkv"]
    attn = model.base_model.model.model.layers[1].self_attn
    dequantize_layer(layers[1])
    want = torch.cat([bnb_f.dequantize_4bit(m.base_layer.weight.data, m.base_layer.weight.quant_state)
                      for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
    assert torch.equal(layers[1].qkv, want)
    _check_against_forward(model, engine)
    with torch.no_grad():  # an optimizer step on the adapters, then the weight sync's update call
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(1.5)
    engine.update_weights([])
    _check_against_forward(model, engine)


def _parsed(argv: list[str]):
    parser = train_ppo.build_parser()
    return parser.parse(argv), parser


def test_qlora_grpo_trains_adapters_over_the_4bit_base(tiny_qwen2_dir, tmp_path, caplog):
    import json

    from safetensors.torch import load_file

    d = write_rl_data(str(tmp_path))
    save = str(tmp_path / "run")
    argv = rl_flags(tiny_qwen2_dir, d, save, "--lora_rank", "4", "--lora_alpha", "8", "--load_in_4bit",
                    "--param_dtype", "bf16", steps=3)
    with caplog.at_level(logging.INFO):
        train_ppo.run.__wrapped__(*_parsed(argv))
    assert "serves the policy's own weights and LoRA adapters, unmerged" in caplog.text
    with open(os.path.join(save, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert len(recs) == 3
    for r in recs:  # the engine's log-probs are the trainer's (a wrong base or stale adapters would not be)
        assert r["train/vllm_kl"] < 2e-3, r["train/vllm_kl"]
    adapters = load_file(os.path.join(save, "adapter_model.safetensors"))
    assert all(".lora_" in k for k in adapters) and len(adapters) == 2 * 7 * 2
    assert max(t.abs().max().item() for k, t in adapters.items() if "lora_B" in k) > 0  # B trained from zero


def test_qlora_resumed_equals_uninterrupted(tiny_qwen2_dir, tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    d = write_rl_data(str(tmp_path))
    qlora = ("--lora_rank", "4", "--lora_alpha", "8", "--load_in_4bit", "--param_dtype", "bf16", "--save_steps", "1")

    def run(name: str, ckpt: str, *extra: str) -> dict:
        save = str(tmp_path / name)
        train_ppo.run.__wrapped__(*_parsed(rl_flags(tiny_qwen2_dir, d, save, *qlora, "--ckpt_path", ckpt,
                                                    "--max_ckpt_num", "5", *extra, steps=3)))
        return load_file(os.path.join(save, "adapter_model.safetensors"))

    whole = run("whole", str(tmp_path / "ck"))
    keys = list(dcp.FileSystemReader(str(tmp_path / "ck" / "actor" / "global_step2" / "dcp")).read_metadata()
                .state_dict_metadata)
    assert any(".lora_A." in k for k in keys) and any("layernorm" in k for k in keys)
    assert not any("_proj.base_layer.weight" in k for k in keys), keys  # no 4-bit weight, no quantization state
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    shutil.rmtree(tmp_path / "ck2" / "actor" / "global_step3")
    (tmp_path / "ck2" / "actor" / "latest").write_text("global_step2")
    resumed = run("resumed", str(tmp_path / "ck2"), "--load_checkpoint")
    assert whole.keys() == resumed.keys()
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k


def test_qlora_refusals(tiny_qwen2_dir, tmp_path):
    d = write_rl_data(str(tmp_path))
    qlora = ("--load_in_4bit", "--param_dtype", "bf16")
    with pytest.raises(UsageError, match="--load_in_4bit .* needs --lora_rank"):
        train_ppo.run.__wrapped__(*_parsed(rl_flags(tiny_qwen2_dir, d, str(tmp_path / "a"), *qlora, steps=1)))
    with pytest.raises(UsageError, match="--load_in_4bit: the rollout engine .* here --engine_weights copy"):
        train_ppo.run.__wrapped__(*_parsed(rl_flags(tiny_qwen2_dir, d, str(tmp_path / "b"), *qlora, "--lora_rank",
                                                    "4", "--engine_weights", "copy", steps=1)))
    from argparse import Namespace

    from rlhfkit.rl_run.ray_layout import check_ray_flags

    with pytest.raises(UsageError, match="--load_in_4bit: train_ppo_ray"):
        check_ray_flags(Namespace(load_in_4bit=True), {})


def test_memory_plan_counts_the_4bit_base():
    from rlhfkit.distributed.memory_plan import (NF4_BYTES, EngineMemory, MemoryInputs, ModelShape, RoleMemory,
                                                 plan_memory)

    s = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=100, qkv_bias=True)
    linear = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # q, o; k, v; gate, up, down
    assert s.linear_params() == linear
    engine = EngineMemory(s, num_engines=1, max_num_seqs=4, max_model_len=64, shares_weights=True)
    x = MemoryInputs(roles=(RoleMemory("policy", s, 1),), engine=engine, lora_rank=4, local=True,
                     colocate_all=True, gradient_checkpointing=False)
    plain = plan_memory(x).pools[0].parts
    quant = plan_memory(MemoryInputs(**{**x.__dict__, "load_in_4bit": True})).pools[0].parts
    base = int(NF4_BYTES * linear) + 2 * (s.num_params() - linear)
    assert plain["policy"]["weights"] == 2 * s.num_params()
    assert quant["policy"]["weights"] == base + 2 * 64 * 128  # + one dequantized gate/up/down weight
    assert quant["engine"]["weights"] - plain["engine"]["weights"] == 2 * linear // 2  # one layer's projections
    # a critic (PPO with GAE) trains adapters over its own 4-bit base too: masters and AdamW for the adapters only
    critic = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=100, qkv_bias=True,
                        value_head=True)
    parts = plan_memory(MemoryInputs(**{**x.__dict__, "load_in_4bit": True, "roles": (
        RoleMemory("policy", s, 1), RoleMemory("critic", critic, 1))})).pools[0].parts["critic"]
    n = critic.lora_params(4)
    assert parts["master"] == 4 * n and parts["optimizer"] == 8 * n and parts["grads"] == 4 * n
    assert parts["weights"] == int(NF4_BYTES * linear) + 2 * (critic.num_params() - linear) + 2 * 64 * 128


def test_batch_inference_generates_from_a_4bit_model(tiny_qwen2_dir, tmp_path, capsys):
    """batch_inference --load_in_4bit: the builtin engine serves the loaded 4-bit module (no bf16 copy) and its
    greedy completions equal the HF engine's (transformers' generate on the same 4-bit model); vLLM is refused."""
    import json

    from rlhfkit.cli.batch_inference import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"q": f"{i} plus {i}"}) + "\n" for i in range(3)))

    def rows(engine: str) -> list[dict]:
        out = tmp_path / f"{engine}.jsonl"
        main(["--eval_task", "generate_vllm", "--pretrain", tiny_qwen2_dir, "--dataset", str(prompts), "--input_key",
              "q", "--max_new_tokens", "8", "--greedy_sampling", "--load_in_4bit", "--rollout_engine", engine,
              "--output_path", str(out), "--disable_progress"])
        return [json.loads(line) for line in out.read_text().splitlines()]

    builtin = rows("builtin")
    assert len(builtin) == 3 and builtin == rows("hf")
    from transformers import AutoTokenizer

    from rlhfkit.cli.batch_inference import build_parser, load_engine

    args = build_parser().parse(["--eval_task", "generate", "--pretrain", tiny_qwen2_dir, "--dataset", str(prompts),
                                 "--output_path", "unused.jsonl", "--load_in_4bit"])
    engine = load_engine(args, AutoTokenizer.from_pretrained(tiny_qwen2_dir), "cpu", 64)
    assert all(len(lw.quant) == 4 for lw in engine.model.weights.layers)  # the module's 4-bit weights, served
    engine.close()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--eval_task", "generate_vllm", "--pretrain", tiny_qwen2_dir, "--dataset", str(prompts), "--input_key",
              "q", "--load_in_4bit", "--rollout_engine", "vllm", "--output_path", str(tmp_path / "v.jsonl")])
    assert "--rollout_engine vllm loads unquantised weights" in capsys.readouterr().err


def test_qlora_ppo_with_a_critic(tiny_qwen2_dir, tmp_path):
    """GAE: the critic is loaded with the policy's --load_in_4bit and --lora_rank and trains (its value loss is
    finite and its forward, with and without gradients, keeps the 4-bit layout it was loaded in)."""
    import json

    d = write_rl_data(str(tmp_path))
    save = str(tmp_path / "run")
    train_ppo.run.__wrapped__(*_parsed(rl_flags(tiny_qwen2_dir, d, save, "--lora_rank", "4", "--lora_alpha", "8",
                                                "--load_in_4bit", "--param_dtype", "bf16", "--advantage_estimator",
                                                "gae", "--critic_learning_rate", "1e-3", steps=2)))
    with open(os.path.join(save, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert len(recs) == 2 and all(r["train/value_loss"] == r["train/value_loss"] for r in recs)  # not NaN


def test_qlora_grpo_on_a_mixture_of_experts(tiny_qwen2_dir, tmp_path):
    """Qwen3-MoE under --load_in_4bit: bitsandbytes quantizes the attention projections (linear layers) and leaves
    the router and the experts (3-D tensors) in bf16; the engine serves both kinds of weight from the policy and
    samples what the trainer scores."""
    import json

    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlhfkit.models.loader import is_4bit

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model_dir = str(tmp_path / "moe")
    Qwen3MoeForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    from rlhfkit.config.configs import ModelConfig
    from rlhfkit.models.loader import load_causal_lm

    loaded = load_causal_lm(ModelConfig(pretrain=model_dir, load_in_4bit=True, lora_rank=4, param_dtype="bf16"))
    four_bit = {n: p for n, p in loaded.named_parameters() if is_4bit(p)}
    assert any("self_attn.q_proj" in n for n in four_bit)
    assert not any("experts" in n or "mlp.gate" in n for n in four_bit)
    from rlhfkit.distributed.memory_plan import ModelShape
    from rlhfkit.rollout.builtin.model.quantized import quantized_shape

    shape = ModelShape.from_config(cfg)  # what the memory plan counts in 4 bits, and the adapters it counts
    assert sum(quantized_shape(p).numel() for p in four_bit.values()) == shape.linear_params()
    assert sum(p.numel() for n, p in loaded.named_parameters() if ".lora_" in n) == shape.lora_params(4)
    d = write_rl_data(str(tmp_path))
    save = str(tmp_path / "run")
    train_ppo.run.__wrapped__(*_parsed(rl_flags(model_dir, d, save, "--lora_rank", "4", "--lora_alpha", "8",
                                                "--load_in_4bit", "--param_dtype", "bf16", steps=2)))
    with open(os.path.join(save, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert len(recs) == 2 and all(abs(r["train/vllm_kl"]) < 2e-3 for r in recs), [r["train/vllm_kl"] for r in recs]
