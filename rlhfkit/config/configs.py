"""Typed per-component configs, built from the parsed flags.

Components take one of these (plus explicit objects), never the argparse namespace.
`from_args(ns)` copies the fields whose names match flag dests; any field may be
overridden by keyword, which is how one CLI builds two configs from different flags
(the PPO actor and critic learning rates, say).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    pretrain: str | None = None
    param_dtype: str = "bf16"  # bf16 | fp16 | fp32
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    gradient_checkpointing_use_reentrant: bool = False
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    lora_dropout: float = 0.0
    load_in_4bit: bool = False
    disable_fast_tokenizer: bool = False
    experts_implementation: str | None = None  # MoE kernels of transformers (eager, grouped_mm, ...)
    freeze_visual_encoder: bool = False  # a VLM's vision tower stays as loaded [--freeze_visual_encoder]


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
    param_dtype: str = "bf16"
    device: str | None = None  # None: cuda when available, else cpu
    adam_offload: bool = False
    seed: int = 42
    gradient_checkpointing: bool = False
    # one process, low-precision compute: "master_weights" (module in the compute dtype, fp32
    # copies in the optimizer) or "autocast" (fp32 module under torch.autocast)
    mixed_precision: str = "master_weights"
    torch_compile: bool = False  # torch.compile each transformer block
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
