"""Rollout engines behind one protocol (rollout/base.py): builtin (fast), hf (reference), vllm.

    choose_engine("auto" | "builtin" | "hf" | "vllm", model) -> EngineChoice   (choice.py: the flag, resolved once)
    build_engine("builtin" | "hf" | "vllm", model_or_path, tokenizer, device, dtype, **options)

`model_or_path` is an HF `*ForCausalLM` module (or a vision-language `*ForConditionalGeneration`), a
model directory or a hub id (its cached snapshot).
The builtin engine reads a directory's safetensors files itself (tensor by tensor; a tensor-parallel
shard, `tp=`, only its slices); the hf engine takes the module (loading the directory with
transformers); vLLM loads the directory itself, so it needs a path.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.rollout.base import RolloutEngine
from rlhfkit.rollout.choice import ENGINES as ENGINE_NAMES
from rlhfkit.rollout.choice import EngineChoice, choose_engine


def _load_hf(model_or_path: Any, tokenizer: Any, dtype: torch.dtype | None) -> tuple[Any, Any]:
    if not isinstance(model_or_path, str):
        return model_or_path, tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from rlhfkit.models.vlm import is_vlm_config

    vlm = is_vlm_config(AutoConfig.from_pretrained(model_or_path))
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    model = auto.from_pretrained(model_or_path, dtype=dtype or "auto")
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_or_path)
    return model.eval(), tokenizer


def _safetensors_dir(model_or_path: Any) -> bool:
    import os

    return isinstance(model_or_path, str) and (
        os.path.exists(os.path.join(model_or_path, "model.safetensors"))
        or os.path.exists(os.path.join(model_or_path, "model.safetensors.index.json")))


def build_engine(name: str, model_or_path: Any, tokenizer: Any = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, tp: Any = None, share_weights: bool = False,
                 **options: Any) -> RolloutEngine:
    """Make the rollout engine `name` (the `--rollout_engine` flag).

    options: builtin -> BuiltinEngineConfig fields (max_num_seqs, max_model_len, ...) and
    eos_token_ids; hf -> max_batch_size, eos_token_ids, pad_token_id; vllm -> VLLMEngine keywords.
    `tp`: this process's `TensorParallelGroup` of a tensor-parallel builtin engine. `share_weights`
    (builtin, `model_or_path` a module being trained in this process): the engine serves the module's
    own weights (BuiltinEngine's `share_weights`).
    """
    if share_weights and (name != "builtin" or isinstance(model_or_path, str)):
        raise ValueError("share_weights: the builtin engine shares the weights of a module it is given, "
                         f"not of {'a model directory' if isinstance(model_or_path, str) else name!r}")
    if name == "auto":
        raise ValueError("build_engine: resolve --rollout_engine auto first (rlhfkit.rollout.choose_engine gives "
                         "the engine for the model)")
    if name not in ENGINE_NAMES:
        raise ValueError(f"--rollout_engine must be one of {ENGINE_NAMES}, got {name!r}")
    if isinstance(model_or_path, str):  # a hub id -> its local snapshot (rlhfkit.models.hub)
        from rlhfkit.models.hub import resolve_model_path

        model_or_path = resolve_model_path(model_or_path, "--pretrain")
    if tp is not None and tp.size > 1 and name != "builtin":
        raise ValueError(f"--vllm_tensor_parallel_size {tp.size}: tensor-parallel engines are the builtin "
                         f"engine's; --rollout_engine {name} runs on one device")
    if name == "vllm":
        from rlhfkit.rollout.vllm_engine import VLLMEngine, import_vllm

        import_vllm()
        if not isinstance(model_or_path, str):
            raise ValueError("--rollout_engine vllm needs a model directory (vLLM loads the weights itself)")
        dt = str(dtype).replace("torch.", "") if dtype is not None else "bfloat16"
        return VLLMEngine(model_or_path, dtype=dt, **options)
    if name == "builtin" and _safetensors_dir(model_or_path):
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_or_path)
        model = model_or_path
    else:
        model, tokenizer = _load_hf(model_or_path, tokenizer, dtype)
    if name == "hf":
        from rlhfkit.rollout.hf_engine import HFEngine

        if dtype is not None:
            model = model.to(dtype)
        return HFEngine(model, tokenizer, device=device, **options)
    from dataclasses import fields

    from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig

    names = {f.name for f in fields(BuiltinEngineConfig)}
    unknown = set(options) - names - {"eos_token_ids"}
    if unknown:
        raise ValueError(f"unknown builtin engine options {sorted(unknown)}; known: {sorted(names)}")
    cfg = BuiltinEngineConfig(**{k: v for k, v in options.items() if k in names})
    return BuiltinEngine(model, tokenizer, device=device, dtype=dtype, config=cfg,
                         eos_token_ids=options.get("eos_token_ids"), tp=tp, share_weights=share_weights)


__all__ = ["ENGINE_NAMES", "EngineChoice", "RolloutEngine", "build_engine", "choose_engine"]
