"""Load Hugging Face tokenizers and causal LMs from a `ModelConfig`.

    load_tokenizer(path)             -> tokenizer (pad token = eos when the tokenizer has none)
    load_causal_lm(cfg, device)      -> AutoModelForCausalLM, with
        dtype              --param_dtype (bf16/fp16/fp32), or `master_dtype` for backends that keep
                           fp32 master weights and cast to --param_dtype for compute (FSDP2 mixed precision)
        attention          --attn_implementation (sdpa default; flash_attention_2 needs `flash_attn`)
        checkpointing      --gradient_checkpointing [--gradient_checkpointing_use_reentrant]
        LoRA               --lora_rank > 0 (peft; see rlhfkit.models.lora)
        QLoRA              --load_in_4bit (bitsandbytes NF4, CUDA only)
    load_value_model(path, ...)      -> reward / critic model (rlhfkit.models.value)

Nothing is downloaded: a model path must be a local directory (the flag that gave it is named in
the error). The small helpers (`resolve_dtype`, `check_attn_implementation`, `check_model_dir`)
are shared with `rlhfkit.models.value` and `rlhfkit.models.lora`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from rlhfkit.backend.precision import DTYPES
from rlhfkit.config.configs import ModelConfig

_DTYPES = {**DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# attention implementations that need an extra package, and which one
_ATTN_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
_ATTN_BUILTIN = {"eager", "sdpa", "flex_attention"}


def resolve_dtype(dtype: str | torch.dtype, flag: str = "--param_dtype") -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"{flag} must be one of bf16, fp16, fp32; got {dtype!r}")
    return _DTYPES[dtype]


def check_model_dir(path: str | None, flag: str = "--pretrain") -> str:
    """Return `path` if it is a local model directory with a config.json, else raise naming `flag`."""
    if not path:
        raise ValueError(f"{flag} is required (a local Hugging Face model directory)")
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{flag} {path!r}: no such directory (models are loaded from local directories; "
            "there is no hub access here)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{flag} {path!r}: directory has no config.json (not a Hugging Face model)")
    return path


def check_attn_implementation(name: str, flag: str = "--attn_implementation") -> str:
    """Validate an attention implementation name; flash attention needs its package installed."""
    if name in _ATTN_PACKAGES:
        pkg = _ATTN_PACKAGES[name]
        if importlib.util.find_spec(pkg) is None:
            raise ImportError(
                f"{flag} {name} needs the `{pkg}` package, which is not installed; "
                f"install it or pass {flag} sdpa")
        return name
    if name in _ATTN_BUILTIN or "/" in name:  # "org/kernel": a hub kernel, left to transformers
        return name
    raise ValueError(f"{flag} must be one of sdpa, eager, flex_attention, flash_attention_2, "
                     f"flash_attention_3; got {name!r}")


def quantization_config(cfg: ModelConfig, skip_modules: list[str] | None = None) -> Any | None:
    """bitsandbytes NF4 config for --load_in_4bit (QLoRA), or None. `skip_modules` stay unquantised
    (a value head: it is trained in full)."""
    if not cfg.load_in_4bit:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError("--load_in_4bit needs the `bitsandbytes` package, which is not installed")
    if not torch.cuda.is_available():
        raise RuntimeError("--load_in_4bit needs a CUDA device (bitsandbytes 4-bit kernels)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=resolve_dtype(cfg.param_dtype),
                              llm_int8_skip_modules=skip_modules)


def load_tokenizer(path: str, padding_side: str = "right", chat_template: str | None = None,
                   use_fast: bool = True, flag: str = "--pretrain") -> Any:
    """Load a tokenizer; the pad token falls back to eos when the tokenizer defines none.

    `padding_side` is passed to the constructor (transformers 5 does not save it as an attribute).
    `chat_template` (--tokenizer_chat_template) replaces the tokenizer's own template.
    """
    from transformers import AutoTokenizer

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    check_model_dir(path, flag)
    tok = AutoTokenizer.from_pretrained(path, padding_side=padding_side, use_fast=use_fast,
                                        trust_remote_code=False)
    tok.padding_side = padding_side
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {flag} {path!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def enable_gradient_checkpointing(model: torch.nn.Module, use_reentrant: bool, need_input_grads: bool) -> None:
    """Turn on activation checkpointing.

    With reentrant checkpointing and frozen embeddings (LoRA, QLoRA) no input of a checkpointed
    block requires grad, so no gradient would flow: `enable_input_require_grads` fixes that.
    """
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if need_input_grads:
        model.enable_input_require_grads()
    if hasattr(model, "config"):
        model.config.use_cache = False


MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def is_moe_config(config: Any) -> bool:
    """Whether a transformers config describes a mixture-of-experts model."""
    return any(getattr(config, k, None) for k in MOE_CONFIG_KEYS)


def experts_kwargs(cfg: ModelConfig, path: str | None) -> dict[str, Any]:
    """`experts_implementation` for `from_pretrained` (--experts_implementation) when the model at
    `path` is a mixture of experts; for a dense model a note says the flag has no effect."""
    if not cfg.experts_implementation:
        return {}
    if path is not None:
        from transformers import AutoConfig

        if not is_moe_config(AutoConfig.from_pretrained(path, trust_remote_code=False)):
            from rlhfkit.config.notes import note_once

            note_once(f"note: --experts_implementation {cfg.experts_implementation} has no effect on {path}: "
                      "not a mixture-of-experts model")
            return {}
    return {"experts_implementation": cfg.experts_implementation}


def pretrained_kwargs(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device | None,
                      skip_quantization: list[str] | None = None, path: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `from_pretrained`: dtype, attention, 4-bit quantization, and the MoE
    experts kernels of the model at `path`."""
    kw: dict[str, Any] = {"dtype": dtype, "attn_implementation": check_attn_implementation(cfg.attn_implementation),
                          "trust_remote_code": False, **experts_kwargs(cfg, path)}
    qcfg = quantization_config(cfg, skip_quantization)
    if qcfg is not None:
        kw["quantization_config"] = qcfg
        kw["device_map"] = {"": torch.device(device) if device is not None else torch.cuda.current_device()}
    return kw


def finish_model(model: Any, cfg: ModelConfig, device: str | torch.device | None,
                 modules_to_save: list[str] | None = None, causal: bool = True) -> Any:
    """Move to `device`, then gradient checkpointing, then LoRA (the order peft expects)."""
    if device is not None and not cfg.load_in_4bit:
        model = model.to(device)
    use_lora = cfg.lora_rank > 0
    if cfg.load_in_4bit and use_lora:  # QLoRA; a 4-bit model without LoRA is for inference only
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, cfg.gradient_checkpointing_use_reentrant, need_input_grads=use_lora)
    if use_lora:
        from rlhfkit.models.lora import apply_lora

        model = apply_lora(model, cfg, modules_to_save=modules_to_save, causal=causal)
    return model


def load_causal_lm(cfg: ModelConfig, device: str | torch.device | None = None,
                   master_dtype: str | torch.dtype | None = None, path: str | None = None,
                   flag: str = "--pretrain") -> Any:
    """Load `cfg.pretrain` (or `path`) as an `AutoModelForCausalLM`.

    Weights are loaded in `master_dtype` when given (e.g. fp32 master weights under FSDP2 mixed
    precision, which casts to --param_dtype for compute), else in --param_dtype.
    """
    from transformers import AutoModelForCausalLM

    path = check_model_dir(path or cfg.pretrain, flag)
    compute = resolve_dtype(cfg.param_dtype)
    dtype = compute if master_dtype is None else resolve_dtype(master_dtype, "master_dtype")
    if cfg.load_in_4bit and compute != torch.bfloat16:
        raise ValueError("--load_in_4bit requires --param_dtype bf16")
    model = AutoModelForCausalLM.from_pretrained(path, **pretrained_kwargs(cfg, dtype, device, path=path))
    return finish_model(model, cfg, device, causal=True)


def load_value_model(*args: Any, **kwargs: Any) -> Any:
    """Reward / critic model; see `rlhfkit.models.value.load_value_model` (re-exported here)."""
    from rlhfkit.models.value import load_value_model as _load

    return _load(*args, **kwargs)


def weight_file_keys(path: str, safetensors_name: str, bin_name: str) -> set[str] | None:
    """Tensor names in `path/safetensors_name` (read from the header) or `path/bin_name`
    (loaded on the meta device); None when neither file exists."""
    st = os.path.join(path, safetensors_name)
    if os.path.isfile(st):
        from safetensors import safe_open

        with safe_open(st, framework="pt") as f:
            return set(f.keys())
    binary = os.path.join(path, bin_name)
    if os.path.isfile(binary):
        return set(torch.load(binary, map_location="meta", weights_only=True, mmap=True))
    return None
