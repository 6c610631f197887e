"""Merging a LoRA adapter into its base model (`lora_combiner`): causal LMs and reward / value
models, written through a staging directory (crash-safe)."""

from __future__ import annotations

import os
from typing import Any

import torch

from rlhfkit.fileio import new_staging_dir, publish_staged
from rlhfkit.models.hf_files import weight_file_keys
from rlhfkit.optional import require

def merge_lora(model_path: str, lora_path: str, output_path: str, is_rm: bool = False,
               param_dtype: str | None = None) -> str:
    """Load base + adapter, merge (W += alpha/r * B A), save model and tokenizer to `output_path`.
    Either path may be a hub id (`rlhfkit.models.hub`). The merged weights are in `param_dtype`, by default
    (None) the base model's dtype (`hf_files.saved_dtype`: its config.json, else its weights; fp32 when
    neither tells).

    With `is_rm` the base is loaded as a reward model (`rlhfkit.models.value`, head name from the
    adapter's or the base's config) and the saved directory keeps the reward config keys
    (`value_head_prefix`, `normalize_reward`, `mean`, `std`).
    """
    require("peft", "lora_combiner")
    from peft import PeftModel

    from rlhfkit.models.hf_files import check_model_dir, load_tokenizer, resolve_dtype, saved_dtype
    from rlhfkit.models.hub import ADAPTER_FILE, resolve_model_path

    model_path = check_model_dir(model_path, "--model_path")
    lora_path = resolve_model_path(lora_path, "--lora_path", required=ADAPTER_FILE)
    if not os.path.isdir(lora_path):
        raise FileNotFoundError(f"--lora_path {lora_path!r}: no such directory")
    if not os.path.isfile(os.path.join(lora_path, "adapter_config.json")):
        raise FileNotFoundError(f"--lora_path {lora_path!r} has no adapter_config.json (not a peft adapter)")
    dtype = resolve_dtype(param_dtype) if param_dtype else (saved_dtype(model_path) or torch.float32)
    if os.path.isfile(os.path.join(lora_path, "tokenizer_config.json")):  # an adapter dir has no config.json
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(lora_path)
    else:
        tokenizer = load_tokenizer(model_path, flag="--model_path")
    if is_rm:
        return _merge_reward_model(model_path, lora_path, output_path, dtype, tokenizer)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    merged = PeftModel.from_pretrained(base, lora_path).merge_and_unload()
    stage = new_staging_dir(output_path)  # published whole (rlhfkit.fileio)
    merged.save_pretrained(stage)
    tokenizer.save_pretrained(stage)
    publish_staged(stage, output_path)
    return output_path


def adapter_keys(lora_path: str) -> set[str]:
    """Tensor names in a peft adapter directory."""
    keys = weight_file_keys(lora_path, "adapter_model.safetensors", "adapter_model.bin")
    if keys is not None:
        return keys
    raise FileNotFoundError(f"--lora_path {lora_path!r} has no adapter_model.safetensors or adapter_model.bin")


def _merge_reward_model(model_path: str, lora_path: str, output_path: str, dtype: torch.dtype,
                        tokenizer: Any) -> str:
    from peft import PeftModel

    from rlhfkit.models.value import checkpoint_keys, load_value_model, reward_settings, save_value_model

    settings = {**reward_settings(model_path), **reward_settings(lora_path)}  # the adapter's config wins
    prefix = settings.get("value_head_prefix", "score")
    # The trained head comes from the adapter (peft modules_to_save) or else from the base.
    head_in_adapter = any(k.endswith(f"{prefix}.weight") for k in adapter_keys(lora_path))
    if not head_in_adapter and f"{prefix}.weight" not in checkpoint_keys(model_path):
        raise ValueError(f"--is_rm: neither --model_path {model_path!r} nor --lora_path {lora_path!r} holds "
                         f"a value head '{prefix}.weight'")
    base = load_value_model(model_path, value_head_prefix=prefix, dtype=dtype, flag="--model_path",
                            allow_missing_head=True)
    merged = PeftModel.from_pretrained(base, lora_path).merge_and_unload()
    save_value_model(merged, output_path, tokenizer, mean=settings.get("mean"), std=settings.get("std"),
                     normalize_reward=settings.get("normalize_reward"))
    return output_path
