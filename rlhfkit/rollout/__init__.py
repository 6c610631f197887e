"""Rollout engines behind one protocol (rollout/base.py): builtin (default, fast), hf (reference), vllm.

    build_engine("builtin" | "hf" | "vllm", model_or_path, tokenizer, device, dtype, **options)

`model_or_path` is an HF `*ForCausalLM` module or a model directory. The builtin and hf engines
take the module (loading the directory with transformers when given a path); vLLM loads the
directory itself, so it needs a path.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.rollout.base import RolloutEngine

ENGINE_NAMES = ("builtin", "hf", "vllm")


def _load_hf(model_or_path: Any, tokenizer: Any, dtype: torch.dtype | None) -> tuple[Any, Any]:
    if not isinstance(model_or_path, str):
        return model_or_path, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=dtype or "auto")
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_or_path)
    return model.eval(), tokenizer


def build_engine(name: str, model_or_path: Any, tokenizer: Any = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, **options: Any) -> RolloutEngine:
    """Make the rollout engine `name` (the `--rollout_engine` flag).

    options: builtin -> BuiltinEngineConfig fields (max_num_seqs, max_model_len, ...) and
    eos_token_ids; hf -> max_batch_size, eos_token_ids, pad_token_id; vllm -> VLLMEngine keywords.
    """
    if name not in ENGINE_NAMES:
        raise ValueError(f"--rollout_engine must be one of {ENGINE_NAMES}, got {name!r}")
    if name == "vllm":
        from rlhfkit.rollout.vllm_engine import VLLMEngine, import_vllm

        import_vllm()
        if not isinstance(model_or_path, str):
            raise ValueError("--rollout_engine vllm needs a model directory (vLLM loads the weights itself)")
        dt = str(dtype).replace("torch.", "") if dtype is not None else "bfloat16"
        return VLLMEngine(model_or_path, dtype=dt, **options)
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
                         eos_token_ids=options.get("eos_token_ids"))


__all__ = ["ENGINE_NAMES", "RolloutEngine", "build_engine"]
