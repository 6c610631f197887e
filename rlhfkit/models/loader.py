"""Load Hugging Face tokenizers and causal LMs from a `ModelConfig`.

    load_tokenizer(path)             -> tokenizer (pad token = eos when the tokenizer has none)
    load_causal_lm(cfg, device)      -> AutoModelForCausalLM (a vision-language model, one whose config has
                                        a vision_config: AutoModelForImageTextToText), with
        dtype              --param_dtype (bf16/fp16/fp32), or `master_dtype` for backends that keep
                           fp32 master weights and cast to --param_dtype for compute (FSDP2 mixed precision)
        attention          --attn_implementation (sdpa default; flash_attention_2 needs `flash_attn`)
        checkpointing      --gradient_checkpointing [--gradient_checkpointing_use_reentrant]
        LoRA               --lora_rank > 0 (peft; see rlhfkit.models.lora)
        QLoRA              --load_in_4bit (bitsandbytes NF4; on CPU bitsandbytes >= 0.48)
        vision tower       --freeze_visual_encoder (a VLM's vision tower does not train; rlhfkit.models.vlm)
    (reward / critic models: rlhfkit.models.value.load_value_model)

A model path is a local directory or a Hugging Face hub id (`org/name`), resolved by `hub.py` through
the hub cache and, when online, the hub (HF_HUB_OFFLINE respected); errors name the flag that gave it.
The file and name helpers live in `hf_files.py` (a leaf, shared with `value.py` and
`lora.py`); imports run one way: hub <- hf_files <- lora <- loader <- value <- lora_merge.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.config.configs import ModelConfig
from rlhfkit.models.hf_files import (  # noqa: F401 - re-exported: loader is where callers look for them
    check_attn_implementation, check_model_dir, load_tokenizer, resolve_dtype, weight_file_keys)
from rlhfkit.models.lora import apply_lora
from rlhfkit.optional import require

def quantization_config(cfg: ModelConfig, skip_modules: list[str] | None = None) -> Any | None:
    """bitsandbytes NF4 config for --load_in_4bit (QLoRA), or None. `skip_modules` stay unquantised
    (a value head: it is trained in full)."""
    if not cfg.load_in_4bit:
        return None
    require("bitsandbytes", "--load_in_4bit")
    import bitsandbytes
    from packaging.version import Version

    if not torch.cuda.is_available() and Version(bitsandbytes.__version__) < Version("0.48"):
        raise RuntimeError(f"--load_in_4bit without a CUDA device needs bitsandbytes 0.48 or newer (its CPU "
                           f"4-bit kernels), got {bitsandbytes.__version__}")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=resolve_dtype(cfg.param_dtype),
                              llm_int8_skip_modules=skip_modules)


def is_4bit(param: torch.Tensor) -> bool:
    """Whether `param` is a bitsandbytes 4-bit weight (--load_in_4bit: packed values with a `quant_state`)."""
    return getattr(param, "quant_state", None) is not None


def keep_4bit_layout(model: torch.nn.Module) -> None:
    """Keep every bitsandbytes 4-bit weight in the layout it was loaded in. On a CPU with AVX512-BF16,
    bitsandbytes repacks a 4-bit weight for its CPU kernel at the first forward pass in eval mode without
    gradients (the reference's or the engine's), after which the weight no longer trains and a rollout
    engine sharing the packed tensor would hold the old one beside the new."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


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


def attention_for(name: str, path: str | None) -> str:
    """--attn_implementation for the model at `path`: as given, except that SDPA becomes eager (with
    one note) for a model class transformers runs without SDPA (gpt-oss: its attention sinks)."""
    name = check_attn_implementation(name)
    if name != "sdpa" or path is None:
        return name
    import transformers
    from transformers import AutoConfig

    archs = getattr(AutoConfig.from_pretrained(path, trust_remote_code=False), "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is not None and getattr(cls, "_supports_sdpa", True) is False:
        from rlhfkit.config.notes import note_once

        note_once(f"note: transformers runs {cls.__name__} without SDPA attention: --attn_implementation eager")
        return "eager"
    return name


def pretrained_kwargs(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device | None,
                      skip_quantization: list[str] | None = None, path: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `from_pretrained`: dtype, attention, 4-bit quantization, and the MoE
    experts kernels of the model at `path`."""
    kw: dict[str, Any] = {"dtype": dtype, "attn_implementation": attention_for(cfg.attn_implementation, path),
                          "trust_remote_code": False, **experts_kwargs(cfg, path)}
    qcfg = quantization_config(cfg, skip_quantization)
    if qcfg is not None:
        kw["quantization_config"] = qcfg
        here = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"  # quantized where it runs
        kw["device_map"] = {"": torch.device(device) if device is not None else here}
    return kw


def finish_model(model: Any, cfg: ModelConfig, device: str | torch.device | None,
                 modules_to_save: list[str] | None = None, causal: bool = True) -> Any:
    """Move to `device`, then gradient checkpointing, then LoRA (the order peft expects); a 4-bit model keeps
    its weights' layout (`keep_4bit_layout`)."""
    if device is not None and not cfg.load_in_4bit:
        model = model.to(device)
    if cfg.load_in_4bit:
        keep_4bit_layout(model)
    use_lora = cfg.lora_rank > 0
    if cfg.load_in_4bit and use_lora:  # QLoRA; a 4-bit model without LoRA is for inference only
        require("peft", "--lora_rank")
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, cfg.gradient_checkpointing_use_reentrant, need_input_grads=use_lora)
    if use_lora:
        from rlhfkit.models.stream_load import adapters_on_host

        with adapters_on_host(model):  # a model on the meta device: adapters keep their initial values
            model = apply_lora(model, cfg, modules_to_save=modules_to_save, causal=causal)
    return model


def load_causal_lm(cfg: ModelConfig, device: str | torch.device | None = None,
                   master_dtype: str | torch.dtype | None = None, path: str | None = None,
                   flag: str = "--pretrain", defer_weights: bool = False) -> Any:
    """Load `cfg.pretrain` (or `path`) as an `AutoModelForCausalLM`, or as an
    `AutoModelForImageTextToText` when its config has a vision config (a VLM).

    Weights are loaded in `master_dtype` when given (e.g. fp32 master weights under FSDP2 mixed
    precision, which casts to --param_dtype for compute), else in --param_dtype. With --lora_rank the
    base is frozen and loaded in --param_dtype (half the host memory of fp32 at bf16); peft keeps the
    adapters in fp32, and the backend casts frozen weights to its compute dtype.

    Host memory (rlhfkit.models.stream_load): with `device`, the model is built on the meta device and
    its safetensors are streamed onto `device` a chunk at a time (never whole in host memory). With
    `defer_weights` (for a model handed straight to `FSDP2Backend`), the model is returned with its
    parameters on the meta device and the backend streams the checkpoint into them after sharding: each
    rank reads and keeps only its shards. A checkpoint that cannot be streamed (no safetensors, names
    transformers converts, 4-bit, a vision-language model) is loaded by transformers as before.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rlhfkit.models.vlm import freeze_visual_encoder, is_vlm_config

    path = check_model_dir(path or cfg.pretrain, flag)
    compute = resolve_dtype(cfg.param_dtype)
    dtype = compute if master_dtype is None or cfg.lora_rank > 0 else resolve_dtype(master_dtype, "master_dtype")
    if cfg.load_in_4bit and compute != torch.bfloat16:
        raise ValueError("--load_in_4bit requires --param_dtype bf16")
    vlm = is_vlm_config(AutoConfig.from_pretrained(path, trust_remote_code=False))
    if cfg.freeze_visual_encoder and not vlm:
        raise ValueError(f"--freeze_visual_encoder: {flag} {path} is not a vision-language model (no vision_config)")
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    model = None
    if not cfg.load_in_4bit and not vlm and (defer_weights or device is not None):
        from rlhfkit.models.stream_load import build_meta_model, materialize

        kw = {k: v for k, v in pretrained_kwargs(cfg, dtype, device, path=path).items()
              if k in ("attn_implementation", "experts_implementation")}
        model = build_meta_model(auto, path, dtype, **kw)
        if model is not None and not defer_weights:
            materialize(model, device)
    if model is None:
        model = auto.from_pretrained(path, **pretrained_kwargs(cfg, dtype, device, path=path))
    if vlm and cfg.freeze_visual_encoder:
        freeze_visual_encoder(model)
    return finish_model(model, cfg, device, causal=True)


def adopt_causal_lm(model: Any, cfg: ModelConfig, flag: str = "--pretrain") -> Any:
    """A causal LM given as a module (rlhfkit.models.given) made ready as `load_causal_lm` makes a loaded one:
    --attn_implementation, the vision tower frozen under --freeze_visual_encoder, then gradient checkpointing
    and LoRA (`finish_model`). Its dtypes and device are the backend's to set, as for a loaded model. The
    module itself is changed and returned (inside a peft wrapper under LoRA): no copy is made."""
    from rlhfkit.models.vlm import freeze_visual_encoder, is_vlm_config

    if cfg.load_in_4bit:
        raise ValueError(f"--load_in_4bit quantizes a model as it loads; {flag} is a module given in memory: "
                         "pass its directory instead")
    vlm = is_vlm_config(model.config)
    if cfg.freeze_visual_encoder and not vlm:
        raise ValueError(f"--freeze_visual_encoder: the {flag} module is not a vision-language model (no vision_config)")
    attn = check_attn_implementation(cfg.attn_implementation)
    if getattr(model.config, "_attn_implementation", attn) != attn:
        model.set_attn_implementation(attn)
    if vlm and cfg.freeze_visual_encoder:
        freeze_visual_encoder(model)
    return finish_model(model, cfg, None, causal=True)
