"""Typed per-component configs: the declarations of their flags (rlhfkit.config.declare), built from the parsed flags.

Components take one of these (plus explicit objects), never the argparse namespace. A field declared
with `flag(...)` is the one declaration of its flag: the parsers add it with `add_fields`
(rlhfkit.config.flags); a field that mirrors a setting declared elsewhere takes its default from
there (`default_of`).
`from_args(ns)` copies the fields whose names match flag dests; any field may be
overridden by keyword, which is how one CLI builds two configs from different flags
(the PPO actor and critic learning rates, say).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from rlhfkit.config.declare import Switch, default_of, flag
from rlhfkit.config.flag_parser import LORA, MODEL

T = TypeVar("T")


def from_args(cls: type[T], ns: argparse.Namespace | None = None, **overrides: Any) -> T:
    """Build dataclass `cls` from namespace attributes with the same names, then overrides."""
    kw: dict[str, Any] = {}
    if ns is not None:
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if hasattr(ns, f.name):
                kw[f.name] = getattr(ns, f.name)
    kw.update(overrides)
    return cls(**kw)  # type: ignore[call-arg]


@dataclass
class ModelConfig:
    """The model to load and how (dtype, attention kernel, LoRA): the flags of the model and LoRA groups."""

    pretrain: str | None = flag(
        None, "--model.model_name_or_path", "--actor.model_name_or_path", group=MODEL,
        help="the model to train or run: a Hugging Face model directory, or a hub id (org/name: the HF cache, else "
             "the hub when online)")
    param_dtype: Literal["bf16", "fp16", "fp32"] = flag(
        "bf16", "--ds.param_dtype", "--fsdp.param_dtype",
        help="compute dtype on GPU (master weights stay fp32); CPU training computes in fp32",
        switches=(Switch("--bf16", "bf16", "alias of --param_dtype bf16"),))
    attn_implementation: str = flag(
        "sdpa", "--ds.attn_implementation", "--fsdp.attn_implementation",
        help="attention kernel of transformers: sdpa, eager, flash_attention_2 (when installed)",
        switches=(Switch("--flash_attn", "flash_attention_2", "alias of --attn_implementation flash_attention_2"),))
    gradient_checkpointing: bool = flag(
        False, "--model.gradient_checkpointing_enable", "--actor.gradient_checkpointing_enable",
        help="recompute activations in the backward pass: less memory, about a third more compute")
    mixed_precision: Literal["master_weights", "autocast"] = flag(
        "master_weights",
        help="one process with bf16/fp16 compute: master_weights (module in the compute dtype, fp32 copies in the "
             "optimizer) or autocast (fp32 module under torch.autocast)")
    torch_compile: bool = flag(False, help="torch.compile each transformer block of trained models")
    gradient_checkpointing_use_reentrant: bool = flag(
        False, "--model.gradient_checkpointing_reentrant", "--actor.gradient_checkpointing_reentrant",
        help="with --gradient_checkpointing: torch's reentrant checkpoint variant (the default is the non-reentrant "
             "one)")
    disable_fast_tokenizer: bool = flag(
        False, "--data.disable_fast_tokenizer", help="load the slow (Python) tokenizer instead of the fast (Rust) one")
    use_liger_kernel: bool = flag(
        False, "--ds.use_liger_kernel", help="OpenRLHF: Liger's fused kernels",
        inert="Liger kernels are not used; the log-prob kernel is fused already (rlhfkit.models.fused_logprobs)")
    aux_loss_coef: float = flag(
        0.0, "--model.aux_loss_coef", "--actor.aux_loss_coef",
        help="weight of a mixture-of-experts model's router load-balancing loss (0: off)")
    experts_implementation: str | None = flag(
        None, "--ds.experts_implementation",
        help="mixture-of-experts kernels of transformers: eager, batched_mm, grouped_mm, deepgemm (default: the "
             "model's own)")
    use_ms: bool = flag(False, help="download model ids from ModelScope (needs modelscope)")
    lora_rank: int = flag(
        0, "--ds.lora.rank", group=LORA,
        help="rank of LoRA adapters on the trained model (0: train all weights); the saved model is the adapter "
             "(peft format)")
    lora_alpha: int = flag(16, "--ds.lora.alpha",
                           help="LoRA scaling numerator: the adapter's update is scaled by alpha / rank")
    target_modules: list[str] = flag(
        ["all-linear"], "--ds.lora.target_modules",
        help="module names that get LoRA adapters (peft's target_modules; all-linear: every linear layer but the "
             "output head)")
    lora_dropout: float = flag(0.0, "--ds.lora.dropout", help="dropout probability on the LoRA adapters' input")
    load_in_4bit: bool = flag(
        False, "--ds.load_in_4bit",
        help="QLoRA: load the frozen base weights in 4-bit NF4 (needs bitsandbytes and CUDA; use with --lora_rank)")
    freeze_visual_encoder: bool = flag(
        False, "--actor.freeze_visual_encoder", group=MODEL,
        help="vision-language models: the vision tower does not train (nor go to the rollout engines); the language "
             "model and its head do")


@dataclass
class OptimConfig:
    learning_rate: float = 5e-6
    adam_betas: tuple[float, float] | list[float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    l2: float = 0.0
    lr_scheduler: str = "cosine_with_min_lr"
    lr_warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1
    max_norm: float = 1.0
    max_nonfinite_steps: int = 3  # skipped non-finite steps in a row before the run stops
    max_weight_growth: float = 100.0  # max |w| beyond this x max(1, its start value) stops the run (0: off)
    max_zero_grad_steps: int = 3  # exactly-zero gradients under a non-zero loss in a row before the run stops
    optim: str = "adam"  # adam (AdamW) | adamw_8bit (8-bit moments) | muon (Muon on hidden 2-D weights, AdamW on the rest)
    master_weights: str = "fp32"  # fp32 masters | bf16_stochastic | bf16_kahan (bf16 weights, backend/lean_adamw.py)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_nesterov: bool = True


@dataclass
class BackendConfig:
    """How a model is wrapped and trained (FSDP2 by default)."""

    backend: str = "fsdp2"
    zero_stage: int = 2
    param_dtype: str = default_of(ModelConfig, "param_dtype")
    device: str | None = None  # None: cuda when available, else cpu
    adam_offload: bool = False
    seed: int = 42
    gradient_checkpointing: bool = default_of(ModelConfig, "gradient_checkpointing")
    mixed_precision: str = default_of(ModelConfig, "mixed_precision")  # see ModelConfig.mixed_precision
    torch_compile: bool = default_of(ModelConfig, "torch_compile")
    # the compiled blocks' shapes: None lets torch decide (static, then dynamic after a second shape);
    # True compiles for any sequence length at once (RL: every step's lengths differ). Not a flag.
    compile_dynamic: bool | None = None
    hf_max_shard_size: str = "5GB"  # largest safetensors file of a Hugging Face export (save_hf)
    save_dtype: str = "auto"  # dtype of save_hf's weights: auto = the loaded folder's, else the compute dtype
    # EMA of the trainable weights (--enable_ema --ema_beta; the policy only): None is off. Not named
    # after a flag, so `from_args` never turns it on for a critic or reference model.
    ema_decay: float | None = None
    # --ring_head_stride: key/value heads that go round the ring together (with --ring_attn_size > 1)
    ring_head_stride: int = 1
    # --max_ckpt_mem: checkpoints under a --ckpt_path may hold this many GB (OpenRLHF's unit); oldest go first
    max_ckpt_mem: float | None = None


@dataclass
class BatchConfig:
    """Global and per-rank batch sizes; `grad_accum_steps` derives from them."""

    train_batch_size: int = 128
    micro_train_batch_size: int = 8

    def grad_accum_steps(self, world_size: int) -> int:
        per_step = self.micro_train_batch_size * world_size
        if self.train_batch_size % per_step != 0:
            raise ValueError(
                f"--train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"--micro_train_batch_size ({self.micro_train_batch_size}) x world size ({world_size}) "
                f"= {per_step}"
            )
        return self.train_batch_size // per_step
