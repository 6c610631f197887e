"""Tensor parallelism (`--ds_tensor_parallel_size N`) for HF decoder models, before FSDP2 wraps them.

`apply_tp(model, tp_mesh)` rewrites the model's layers in place with
`torch.distributed.tensor.parallel.parallelize_module` over the mesh's "tp" dimension (FSDP2 then
shards the resulting DTensors over the data-parallel dims: 2-D parameters, sharding.py):

    embed_tokens            vocab-parallel (row-wise): each rank embeds its vocabulary rows, the
                            partial embeddings are summed (all-reduce), output replicated
    self_attn.q/k/v_proj    column-wise: each rank computes N_heads / tp query heads and
                            N_kv / tp key-value heads (HF reshapes with -1 heads: local heads)
    self_attn.o_proj        row-wise: partial outputs summed over the group
    mlp.gate/up_proj        column-wise (intermediate / tp features)
    mlp.down_proj           row-wise
    lm_head                 column-wise over the vocabulary, output left sharded (a DTensor
                            Shard(-1)): log-probs use vocab_parallel.py and never gather it
    norms, rotary, value /  replicated (every tp rank computes them on the same replicated
    reward head (score)     activations and gets the same gradient)

Tied embeddings (`tie_word_embeddings`, e.g. Qwen2-0.5B): the embedding and `lm_head` shard the same
[V, H] matrix by vocabulary rows, so the one DTensor is tied again after parallelizing.

Supported: Llama, Qwen2, Qwen3 and Mistral (HF module names), causal LMs and their value / reward
models. Anything else (another architecture, MoE, LoRA layers, sizes that the tp size does not
divide) is refused with one line naming --ds_tensor_parallel_size. No sequence parallelism: the
activations between blocks are replicated over the tp group. Rank 0 prints one note line when it
parallelizes a model (how a log shows that the flag took effect).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlhfkit.config.notes import note_once
from rlhfkit.models.hf_config import ConfigFields, config_of

FLAG = "--ds_tensor_parallel_size"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _config(model: nn.Module) -> Any:
    """The model's HF config (Any: a family's fields are read by name)."""
    config = config_of(model)
    if config is None:
        raise ValueError(f"{FLAG}: the model has no HF config; tensor parallelism needs a Llama, Qwen2, Qwen3 "
                         "or Mistral model")
    return config


def check_tp_model(model: nn.Module, tp: int) -> None:
    """Raise one ValueError line naming --ds_tensor_parallel_size when `model` cannot be split `tp` ways."""
    config = _config(model)
    f = ConfigFields.of(config)
    kind = f.model_type
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{FLAG} {tp}: tensor parallelism supports model types {', '.join(SUPPORTED_MODEL_TYPES)}, "
                         f"not {kind!r}")
    if any(type(m).__module__.startswith("peft") for m in model.modules()):
        raise ValueError(f"{FLAG} {tp}: tensor parallelism does not support LoRA adapters (--lora_rank)")
    heads = config.num_attention_heads
    sizes = {"num_attention_heads": heads,
             "num_key_value_heads": f.num_key_value_heads or heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"{FLAG} {tp} does not divide the model's {name} ({size})")


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """{module name: ParallelStyle} of `model` (module docstring); names are the model's own."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    found = {"embed_tokens": 0, "colwise": 0, "rowwise": 0}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embed_tokens":
            if not isinstance(mod, nn.Embedding):
                raise ValueError(f"{FLAG}: {name} is a {type(mod).__name__}, not an nn.Embedding")
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            found["embed_tokens"] += 1
        elif name == "lm_head" or name.endswith(".lm_head"):
            if not isinstance(mod, nn.Linear):
                raise ValueError(f"{FLAG}: {name} is a {type(mod).__name__}, not an nn.Linear")
            plan[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        else:
            for kind, suffixes, style in (("colwise", _COLWISE, ColwiseParallel), ("rowwise", _ROWWISE, RowwiseParallel)):
                if any(name.endswith("." + s) for s in suffixes):
                    if not isinstance(mod, nn.Linear):
                        raise ValueError(f"{FLAG}: {name} is a {type(mod).__name__}, not an nn.Linear "
                                         "(mixture-of-experts and adapter layers are not supported)")
                    plan[name] = style()
                    found[kind] += 1
    layers = _config(model).num_hidden_layers
    if found != {"embed_tokens": 1, "colwise": 5 * layers, "rowwise": 2 * layers}:
        raise ValueError(f"{FLAG}: the model's modules do not match the Llama/Qwen/Mistral layout "
                         f"(found {found} for {layers} layers)")
    return plan


def _tied_pairs(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(owner, attribute, tied-to owner, attribute) for parameters shared between two modules."""
    first: dict[int, tuple[nn.Module, str]] = {}
    pairs = []
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) in first and first[id(p)][0] is not mod:
                pairs.append((mod, attr, *first[id(p)]))
            else:
                first.setdefault(id(p), (mod, attr))
    return pairs


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Parallelize `model` in place over the 1-D `tp_mesh` (module docstring); returns `model`."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check_tp_model(model, tp)
    plan = tp_plan(model)
    tied = _tied_pairs(model)
    parallelize_module(model, tp_mesh, plan)
    for mod, attr, src, src_attr in tied:  # parallelize_module replaced each side with its own DTensor
        setattr(mod, attr, getattr(src, src_attr))
    note_once(f"note: tensor parallelism: attention, MLP, embedding and lm_head split over {tp} ranks "
              f"({FLAG})")
    return model
