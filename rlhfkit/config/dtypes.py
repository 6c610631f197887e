"""The one `--param_dtype` table (shared by models, backend, rollout and the CLIs), and every torch
dtype by its torch name."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# "bfloat16", "float32", "half", ...: a saved config's or a weight-sync record's dtype string
TORCH_DTYPES: dict[str, torch.dtype] = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


def dtype_flag_name(dtype: torch.dtype) -> str:
    """torch dtype -> its --param_dtype name (bf16 | fp16 | fp32)."""
    return next(k for k, v in DTYPES.items() if v == dtype)


def run_dtype(param_dtype: str, device: str) -> torch.dtype:
    """What an inference-only model (a rollout engine) computes in: --param_dtype on a GPU, fp32 on CPU."""
    return DTYPES[param_dtype] if device.startswith("cuda") else torch.float32
