"""The memory plan (rlhfkit.distributed.memory_plan) against numbers worked out by hand.

Qwen2.5-7B: H 3584, 28 layers, 28 heads (q = 3584), 4 KV heads (kv = 512, head_dim 128),
I 18944, V 152064, q/k/v biases, untied head.
    layer = 2*3584*3584 + 2*3584*512 + 3*3584*18944 + 2*3584 + (3584 + 2*512)
          = 25,690,112 + 3,670,016 + 203,685,888 + 7,168 + 4,608 = 233,057,792
    root  = 2 * 152064*3584 + 3584 = 1,089,998,336
    P     = 28 * 233,057,792 + 1,089,998,336 = 7,615,616,512   (the published 7.61B)
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
import sys

import pytest
import torch

from rlhfkit.distributed.memory_plan import (CONTEXT_BYTES, CONTEXT_SHARDED_BYTES, ENGINE_TP_BYTES,
                                             ENGINE_WORKSPACE_BYTES, EngineMemory, MemoryInputs, ModelShape,
                                             RoleMemory, over_budget, plan_memory)

GiB = 2**30
QWEN7B = ModelShape(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064,
                    qkv_bias=True)
P = 7_615_616_512


def test_qwen25_7b_parameter_count_by_hand():
    assert QWEN7B.layer_params() == 233_057_792
    assert QWEN7B.root_params() == 1_089_998_336
    assert QWEN7B.num_params() == P
    critic = QWEN7B.num_params() - 152064 * 3584 + 3584  # score head H x 1 instead of the LM head
    assert ModelShape.from_config({**cfg_dict(), "model_type": "qwen2"}, value_head=True).num_params() == critic


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_dense_first", "mixtral"])
def test_parameter_count_of_a_mixture_of_experts(arch):
    """Routed experts (each expert's gate, up and down, and the router) in place of a MoE layer's dense MLP;
    Qwen3-MoE's mlp_only_layers keep a dense one."""
    import transformers

    small = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                 intermediate_size=160, vocab_size=500)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)
    else:
        cfg = transformers.Qwen3MoeConfig(**small, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                          mlp_only_layers=[0] if arch.endswith("first") else [])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shape = ModelShape.from_config(cfg)
    assert shape.moe_layers == (2 if arch.endswith("first") else 3) and shape.experts_per_token == 2
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


def cfg_dict() -> dict:
    return dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_parameter_count_matches_transformers_on_the_meta_device(arch):
    import transformers

    small = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                 intermediate_size=160, vocab_size=500, tie_word_embeddings=arch == "llama")
    cfg = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
           "qwen3": transformers.Qwen3Config}[arch](**small)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert ModelShape.from_config(cfg).num_params() == sum(p.numel() for p in model.parameters())
    cfg.num_labels = 1
    with torch.device("meta"):
        cls = transformers.AutoModelForSequenceClassification.from_config(cfg)
    assert ModelShape.from_config(cfg, value_head=True).num_params() == sum(p.numel() for p in cls.parameters())


def grpo_7b(**kw) -> MemoryInputs:
    """The issue's run: GRPO on 4 GPUs, policy + ref + 4 builtin engines colocated, both sleeps,
    bf16, ZeRO-2, checkpointing, micro-batches of 2048 tokens, 64 sequences x 2048 tokens per engine."""
    x = MemoryInputs(roles=(RoleMemory("policy", QWEN7B, 4), RoleMemory("ref", QWEN7B, 4)),
                     engine=EngineMemory(QWEN7B, num_engines=4, max_num_seqs=64, max_model_len=2048),
                     zero_stage=2, gradient_checkpointing=True, train_tokens=2048, forward_tokens=2048,
                     colocate_all=True, engine_sleep=True, train_sleep=True)
    from dataclasses import replace

    return replace(x, **kw)


# per layer and token: A = 16*3584 + 2*(2*3584 + 3*3584 + 3*512 + 4*18944) = 57,344 + 190,464 = 247,808
A = 247_808
HEAD = 2048 * 152064 * 2  # 622,854,144 B of bf16 logits: under the 1 GiB chunk
# checkpointing: block inputs + one block recomputed and its activations' gradients
TRAIN_ACT = 2048 * (28 * 2 * 3584 + 2 * A) + HEAD  # = 2,048,917,504
FWD_ACT = 2048 * A + HEAD  # 1,130,364,928
VOCAB_GRAD = 2 * 152064 * 3584  # one vocabulary matrix's unsharded bf16 gradient: 1,089,994,752
KV = 2 * 28 * 64 * 4 * 2048 * 128 * 2  # 7,516,192,768
ENGINE_CTX = CONTEXT_BYTES + ENGINE_WORKSPACE_BYTES
CTX = 2 * CONTEXT_SHARDED_BYTES + ENGINE_CTX  # policy and ref ranks (NCCL) + the engine: 7.75 GiB
POLICY = P + 2 * P + P + VOCAB_GRAD + 2 * P + TRAIN_ACT + 2 * P + CTX  # = 72,385,343,488 (67.4 GiB)


def test_qwen25_7b_colocated_grpo_by_hand():
    plan = plan_memory(grpo_7b())
    (pool,) = plan.pools
    assert pool.name == "all" and pool.gpus == 4 and pool.members == ["policy", "ref", "engine"]
    policy = pool.parts["policy"]
    assert policy["master"] == 4 * P // 4 == 7_615_616_512  # fp32 shards
    assert policy["optimizer"] == 8 * P // 4 and policy["grads"] == 4 * P // 4 + VOCAB_GRAD
    assert policy["weights"] == 2 * P  # ZeRO-2: all blocks gathered in bf16 between forward and backward
    assert policy["activations"] == TRAIN_ACT == 2_048_917_504
    assert policy["context"] == CONTEXT_SHARDED_BYTES and pool.parts["engine"]["context"] == ENGINE_CTX
    assert pool.parts["ref"]["weights"] == 2 * P and pool.parts["ref"]["activations"] == FWD_ACT
    assert pool.parts["engine"]["weights"] == 2 * P and pool.parts["engine"]["kv_cache"] == KV == 7_516_192_768
    # generate: engine awake, training states asleep; policy: its states + the builtin engine's
    # weights (sleep level 1 keeps them); ref: its gathered weights + the engine's weights
    assert pool.phases["generate"] == 2 * P + KV + CTX
    assert pool.phases["policy"] == POLICY == 72_385_343_488
    assert pool.phases["ref"] == 2 * P + FWD_ACT + 2 * P + CTX
    assert plan.peak == POLICY and pool.peak_phase == "policy"  # 67.4 GiB
    assert over_budget(grpo_7b(), 80 * GiB) is None


def test_the_head_keeps_its_logits_only_where_half_the_free_memory_holds_them():
    x = grpo_7b(train_tokens=8192)
    whole = 8192 * 152064 * 2  # 2.32 GiB of logits; the plan already counts one 1 GiB chunk
    roomy = plan_memory(x, 139 * GiB).pools[0]
    assert roomy.optional == {"policy": whole - GiB} and roomy.expected_peak == roomy.peak + whole - GiB
    need = roomy.phases["policy"]
    tight = plan_memory(x, need + 2 * whole - 1).pools[0]  # half of what is free is one byte short
    assert tight.optional == {"policy": 0} and tight.expected_peak == tight.peak
    assert plan_memory(x).pools[0].optional == {}  # the GPU's size unknown: nothing optional
    assert over_budget(x, need + 1) is None  # never a reason to refuse


def test_lora_keeps_a_frozen_base_and_trains_the_adapters():
    n = 28 * 16 * ((3584 + 3584) * 2 + (3584 + 512) * 2 + (3584 + 18944) * 3)  # rank 16 on every linear
    assert QWEN7B.lora_params(16) == n == 40_370_176
    policy = plan_memory(grpo_7b(lora_rank=16, zero_stage=3)).pools[0].parts["policy"]
    assert policy["master"] == 4 * n // 4 and policy["optimizer"] == 8 * n // 4 and policy["grads"] == 4 * n // 4
    assert policy["weights"] == 2 * P // 4  # the frozen shards outweigh two gathered blocks
    full = plan_memory(grpo_7b(zero_stage=3)).pools[0].parts["policy"]
    assert full["master"] + full["optimizer"] + full["grads"] == 16 * P // 4 + VOCAB_GRAD
    # one rank: the module in bf16 (the base frozen), fp32 masters, Adam and gradients of the adapters only
    one = plan_memory(grpo_7b(lora_rank=16, roles=(RoleMemory("policy", QWEN7B, 1),))).pools[0].parts["policy"]
    assert (one["weights"], one["master"], one["optimizer"], one["grads"]) == (2 * P, 4 * n, 8 * n, 4 * n)


def test_without_train_sleep_the_ref_stays_and_vllm_sleep_frees_the_engine():
    awake = plan_memory(grpo_7b(train_sleep=False)).pools[0]
    assert awake.phases["policy"] == POLICY + 2 * P  # + the ref's gathered bf16 weights
    assert awake.phases["generate"] == 2 * P + KV + (3 * P) + 2 * P + CTX  # + policy master/Adam + ref
    vllm = grpo_7b(engine=EngineMemory(QWEN7B, num_engines=4, max_num_seqs=64, max_model_len=2048, kind="vllm",
                                       gpu_memory_utilization=0.5))
    pool = plan_memory(vllm, 80 * GiB).pools[0]
    assert pool.parts["engine"]["kv_cache"] == 40 * GiB - 2 * P  # vllm reserves half the GPU
    assert pool.phases["policy"] == POLICY - 2 * P  # asleep, vllm keeps no weights


def test_over_budget_names_the_numbers_and_the_flags_that_fit():
    msg = over_budget(grpo_7b(), 40 * GiB)
    assert msg.startswith("the memory plan needs about 67.4 GiB per GPU in pool all (policy) but the GPU has 40.0 GiB")
    # --adam_offload: the policy keeps only its gathered weights and activations on the GPU:
    # 2P + TRAIN_ACT + VOCAB_GRAD (reduce-scattered before its copy to the host) + 2P (engine) + contexts
    # = 41,922,877,440 B = 39.0 GiB
    assert "--adam_offload (39.0 GiB)" in msg and "would fit with" in msg
    assert "not enough alone: --gradient_checkpointing" not in msg  # already set: not suggested
    assert "--zero_stage 3 (" in msg.split("not enough alone:")[1]  # tried, reported with its number
    hopeless = over_budget(grpo_7b(), 10 * GiB)
    assert "no single change fits" in hopeless and "--adam_offload (39.0 GiB)" in hopeless


def test_separate_pools_one_process_policy_and_engine_pool():
    x = MemoryInputs(roles=(RoleMemory("policy", QWEN7B, 1),),
                     engine=EngineMemory(QWEN7B, num_engines=2, max_num_seqs=8, max_model_len=1024, tp=2),
                     gradient_checkpointing=True, train_tokens=1024)
    pools = {p.name: p for p in plan_memory(x).pools}
    assert set(pools) == {"policy", "engines"} and pools["engines"].gpus == 4
    # one process: bf16 module 2P + fp32 masters 4P + Adam 8P + fp32 grads 4P; no NCCL buffers
    assert pools["policy"].phases["policy"] == (18 * P + 1024 * (28 * 2 * 3584 + 2 * A) + 1024 * 152064 * 2
                                                + CONTEXT_BYTES)
    # tensor parallel 2: half the weights, 2 of the 4 KV heads on each GPU, and its communicators
    assert pools["engines"].phases["generate"] == (2 * P // 2 + 2 * 28 * 8 * 2 * 1024 * 128 * 2 + ENGINE_CTX
                                                   + ENGINE_TP_BYTES)


def test_the_plan_module_does_not_import_ray():
    code = "import sys, rlhfkit.distributed.memory_plan; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_lean_optimizer_options_by_hand():
    """--optim adamw_8bit: moments 1 byte each + an fp32 maximum per 256 values = 2.03125 B a parameter;
    --master_weights bf16_*: weights and gradients 2 B (no fp32 master, no separate bf16 module), bf16_kahan
    + 2 B of compensation. 7.6B on one GPU: 6.03 P = 42.8 GiB, or 8.03 P = 57.0 GiB (fp32 + Adam: 18 P)."""
    one = (RoleMemory("policy", QWEN7B, 1),)
    lean = plan_memory(grpo_7b(roles=one, optimizers=(("policy", "adamw_8bit", "bf16_stochastic"),)))
    parts = lean.pools[0].parts["policy"]
    assert (parts["weights"], parts["master"], parts["grads"]) == (0, 2 * P, 2 * P)
    assert parts["optimizer"] == int(2.03125 * P)
    assert sum(parts[k] for k in ("weights", "master", "grads", "optimizer")) / GiB == pytest.approx(42.78, abs=0.01)
    kahan = plan_memory(grpo_7b(roles=one, optimizers=(("policy", "adamw_8bit", "bf16_kahan"),))).pools[0]
    assert kahan.parts["policy"]["optimizer"] == int(4.03125 * P)
    fp32 = plan_memory(grpo_7b(roles=one)).pools[0].parts["policy"]
    assert sum(fp32[k] for k in ("weights", "master", "grads", "optimizer")) == 18 * P
    # sharded over 4 (ZeRO-2): each part divided by 4; the critic's settings do not touch the policy
    shard = plan_memory(grpo_7b(optimizers=(("policy", "adamw_8bit", "fp32"), ("critic", "adam", "bf16_kahan"))))
    policy = shard.pools[0].parts["policy"]
    assert policy["master"] == 4 * P // 4 and policy["optimizer"] == int(2.03125 * P) // 4
    assert policy["grads"] == 4 * P // 4 + VOCAB_GRAD


def test_over_budget_suggests_the_lean_optimizer_flags():
    msg = over_budget(grpo_7b(), 40 * GiB)
    assert "--optim adamw_8bit (" in msg and "--master_weights bf16_stochastic (" in msg
    done = over_budget(grpo_7b(optimizers=(("policy", "adamw_8bit", "bf16_stochastic"),)), 40 * GiB)
    assert "--optim adamw_8bit (" not in done and "--master_weights bf16_stochastic (" not in done


def test_train_ppo_engine_serving_the_policy_weights_holds_none_of_its_own():
    """train_ppo (local): the policy and an engine in one process on one GPU, nothing asleep. An engine that
    serves the policy's weights (--engine_weights) adds its KV cache and context only: 7.6B lean, one GPU, the
    policy phase is the policy's 6.03 P + activations + both contexts + the awake engine's KV cache; its own
    copy adds 2 P (14.2 GiB). The advice names the engine's sleep but not the models' (train_ppo has none) and
    torchrun for more GPUs; asleep, the sharing engine holds nothing in the policy phase."""
    one = (RoleMemory("policy", QWEN7B, 1),)
    lean = (("policy", "adamw_8bit", "bf16_stochastic"),)

    def local(shares: bool) -> MemoryInputs:
        eng = EngineMemory(QWEN7B, num_engines=1, max_num_seqs=128, max_model_len=392, shares_weights=shares)
        return grpo_7b(roles=one, optimizers=lean, engine=eng, local=True, engine_sleep=False, train_sleep=False)

    shared, copied = plan_memory(local(True)).pools[0], plan_memory(local(False)).pools[0]
    kv = 2 * 28 * 128 * 4 * 392 * 128 * 2
    assert shared.parts["engine"]["weights"] == 0 and shared.parts["engine"]["kv_cache"] == kv
    assert copied.phases["policy"] - shared.phases["policy"] == 2 * P
    assert copied.phases["generate"] - shared.phases["generate"] == 2 * P
    msg = over_budget(local(True), 40 * GiB)
    assert "--deepspeed_enable_sleep" not in msg and "--vllm_enable_sleep (" in msg
    assert "torchrun --nproc_per_node 2" in msg and "--actor_num_gpus" not in msg
    asleep = plan_memory(replace(local(True), engine_sleep=True)).pools[0]
    assert shared.phases["policy"] - asleep.phases["policy"] == kv


def test_torch_compile_keeps_no_fp32_norm_copies_in_the_trained_blocks():
    # compiled: two fused RMSNorms keep one fp32 scale a token each: A = 8 + 190,464 = 190,472
    compiled = 8 + 2 * (2 * 3584 + 3 * 3584 + 3 * 512 + 4 * 18944)
    assert QWEN7B.activation_bytes_per_token_layer(2, compiled=True) == compiled == 190_472
    assert QWEN7B.activation_bytes_per_token_layer(2) == A
    tokens = 16 * 384  # 16 sequences of 384 tokens, no checkpointing: every block's activations + the head's
    head = min(GiB, tokens * 152064 * 2)
    x = grpo_7b(roles=(RoleMemory("policy", QWEN7B, 1), RoleMemory("ref", QWEN7B, 1)), gradient_checkpointing=False,
                train_tokens=tokens, torch_compile=True)
    pool = plan_memory(x).pools[0]
    assert pool.parts["policy"]["activations"] == tokens * 29 * compiled + head
    eager = plan_memory(replace(x, torch_compile=False)).pools[0]
    assert eager.parts["policy"]["activations"] == tokens * 29 * A + head
    assert pool.parts["ref"] == eager.parts["ref"]  # an untrained model's forward is not compiled
    # with checkpointing: the block inputs + one block recomputed with its activations' gradients
    ckpt = plan_memory(replace(x, gradient_checkpointing=True)).pools[0]
    assert ckpt.parts["policy"]["activations"] == tokens * (28 * 2 * 3584 + 2 * compiled) + head
