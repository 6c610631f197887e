"""LoRA adapters (peft): attach them for training and merge them into a base model.

LoRA (Hu et al., 2021, arXiv:2106.09685) replaces a frozen weight W by W + (alpha / r) * B A with
A in R^{r x in}, B in R^{out x r}; merging writes that sum back into W, so the merged model gives the
adapted model's outputs with no adapter at run time.

    apply_lora(model, cfg)                       --lora_rank/--lora_alpha/--target_modules/--lora_dropout
    merge_lora(model_path, lora_path, out, ...)  the `lora_combiner` CLI

`--target_modules all-linear` means every linear layer of the backbone: the output layer (`lm_head`)
and a value/reward head are excluded; a value head is trained in full (peft `modules_to_save`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlhfkit.config.configs import ModelConfig
from rlhfkit.fileio import new_staging_dir, publish_staged
from rlhfkit.models.loader import weight_file_keys

OUTPUT_LAYER_NAMES = ("lm_head",)


def linear_module_names(model: torch.nn.Module, exclude: tuple[str, ...] = ()) -> list[str]:
    """Sorted distinct leaf names of the linear layers, skipping `exclude` and the output layer."""
    skip = set(OUTPUT_LAYER_NAMES) | set(exclude)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for full_name, module in model.named_modules():
        leaf = full_name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and module is not out_emb and leaf not in skip:
            names.add(leaf)
    if not names:
        raise ValueError("--target_modules all-linear: the model has no linear layers to adapt")
    return sorted(names)


def resolve_target_modules(model: torch.nn.Module, targets: list[str] | str,
                           exclude: tuple[str, ...] = ()) -> list[str]:
    """Expand 'all-linear'; check that every named module exists."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    if not targets:
        raise ValueError("--target_modules is empty; pass module names or all-linear")
    if "all-linear" in targets:
        if len(targets) > 1:
            raise ValueError(f"--target_modules: all-linear cannot be combined with other names, got {targets}")
        return linear_module_names(model, exclude)
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in leaves]
    if missing:
        raise ValueError(f"--target_modules {missing} not found in the model; "
                         f"linear layers are {linear_module_names(model, exclude)}")
    return targets


def lora_config(model: torch.nn.Module, cfg: ModelConfig, modules_to_save: list[str] | None = None,
                causal: bool = True) -> Any:
    """peft LoraConfig from the --lora_* flags."""
    from peft import LoraConfig, TaskType

    if cfg.lora_rank <= 0:
        raise ValueError(f"--lora_rank must be > 0 to use LoRA, got {cfg.lora_rank}")
    exclude = tuple(modules_to_save or ())
    return LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        target_modules=resolve_target_modules(model, cfg.target_modules, exclude),
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        task_type=TaskType.CAUSAL_LM if causal else None, bias="none")


def apply_lora(model: torch.nn.Module, cfg: ModelConfig, modules_to_save: list[str] | None = None,
               causal: bool = True) -> Any:
    """Wrap `model` in a peft model with fresh adapters (B = 0, so outputs are unchanged)."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(model, cfg, modules_to_save, causal))


def merge_lora(model_path: str, lora_path: str, output_path: str, is_rm: bool = False,
               param_dtype: str = "bf16") -> str:
    """Load base + adapter, merge (W += alpha/r * B A), save model and tokenizer to `output_path`.

    With `is_rm` the base is loaded as a reward model (`rlhfkit.models.value`, head name from the
    adapter's or the base's config) and the saved directory keeps the reward config keys
    (`value_head_prefix`, `normalize_reward`, `mean`, `std`).
    """
    from peft import PeftModel

    from rlhfkit.models.loader import check_model_dir, load_tokenizer, resolve_dtype

    check_model_dir(model_path, "--model_path")
    if not os.path.isfile(os.path.join(lora_path, "adapter_config.json")):
        raise FileNotFoundError(f"--lora_path {lora_path!r} has no adapter_config.json (not a peft adapter)")
    dtype = resolve_dtype(param_dtype)
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
