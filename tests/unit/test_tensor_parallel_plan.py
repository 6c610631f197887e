"""Tensor-parallel plan and refusals (no process group needed): which layers split how, and one
error line naming --ds_tensor_parallel_size for what cannot be split."""

from __future__ import annotations

import re

import pytest
import torch

from rlhfkit.parallel.mesh import ParallelDims
from rlhfkit.parallel.tensor_parallel import check_tp_model, tp_plan


def tiny(arch: str = "llama", vocab: int = 104, heads: int = 4, kv: int = 2, inter: int = 96, tied: bool = False):
    from transformers import AutoModelForCausalLM

    from rlhfkit.models.tiny import TinyModelSpec, build_config, build_tokenizer

    spec = TinyModelSpec(arch=arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(build_config(spec, vocab, build_tokenizer()))


def test_plan_splits_attention_mlp_embedding_and_head():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = tp_plan(tiny())
    for i in range(2):
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert type(plan[f"model.layers.{i}.{m}"]) is ColwiseParallel
        for m in ("self_attn.o_proj", "mlp.down_proj"):
            assert type(plan[f"model.layers.{i}.{m}"]) is RowwiseParallel
    assert type(plan["model.embed_tokens"]) is RowwiseParallel
    head = plan["lm_head"]
    assert type(head) is ColwiseParallel and head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert len(plan) == 2 * 7 + 2  # norms, rotary tables: replicated (not in the plan)


def test_plan_covers_a_value_model_without_lm_head():
    from rlhfkit.models.value import value_model_class

    cfg = tiny("qwen2").config
    model = value_model_class(cfg)(cfg)
    plan = tp_plan(model)
    assert "lm_head" not in plan and "score" not in plan and "model.embed_tokens" in plan


@pytest.mark.parametrize("kw, what", [({"vocab": 103}, "vocab_size (103)"),
                                      ({"heads": 4, "kv": 4, "inter": 97}, "intermediate_size (97)"),
                                      ({"heads": 4, "kv": 1}, "num_key_value_heads (1)")])
def test_sizes_the_tp_size_does_not_divide_are_refused(kw, what):
    with pytest.raises(ValueError, match=r"--ds_tensor_parallel_size 2 does not divide the model's " + re.escape(what)):
        check_tp_model(tiny(**kw), 2)


def test_unknown_architecture_and_lora_are_refused():
    with pytest.raises(ValueError, match="--ds_tensor_parallel_size 2: tensor parallelism supports model types"):
        check_tp_model(tiny("mixtral"), 2)
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="--ds_tensor_parallel_size 2: .*LoRA"):
        check_tp_model(model, 2)


def test_tp_is_supported_by_the_mesh_and_the_flag_check():
    import argparse

    from rlhfkit.cli.common import check_backend_flags

    dims = ParallelDims.from_flags(4, 2, tensor_parallel_size=2)
    dims.check_supported()
    assert (dims.dp_shard, dims.tp) == (2, 2)
    check_backend_flags(argparse.Namespace(ds_tensor_parallel_size=2, ring_attn_size=1, backend="fsdp2"))
    with pytest.raises(ValueError, match="--ds_tensor_parallel_size"):
        ParallelDims.from_flags(3, 2, tensor_parallel_size=2)


def test_forward_logits_gathers_and_token_logprobs_use_plain_logits_without_tp():
    from rlhfkit.models.forward import forward_logits, token_logprobs

    model = tiny().eval()
    ids = torch.randint(0, 104, (2, 6))
    with torch.no_grad():
        logits = forward_logits(model, ids)
        lp = token_logprobs(model, ids, fused=False)
    ref = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(lp[:, 1:], ref, atol=1e-5)
