"""Mixed-precision choices of the training backend and a dynamic loss scaler for fp16.

Master weights and optimizer states are always fp32. `--param_dtype` sets the *compute* dtype:

* sharded (FSDP2): `MixedPrecisionPolicy(param_dtype=<compute>, reduce_dtype=fp32)`: the
  all-gathered parameters are cast to the compute dtype, gradients are reduced in fp32;
* one process on CUDA: the model's forward runs under `torch.autocast("cuda", <compute>)`;
* on CPU, bf16 / fp16 compute is slow (and only emulated for fp16), so the compute dtype is fp32
  unless the caller passes `cpu_low_precision=True`. This is logged once, never silent.

fp16 needs loss scaling: `DynamicLossScaler` multiplies the loss by S, un-scales the gradients
before clipping, halves S and skips the step on inf/nan, and doubles S after `growth_interval`
good steps (dynamic loss scaling). bf16 and fp32 need none.

Not implemented: a "pure bf16" mode (bf16 parameters with fp32 optimizer states, which halves
parameter memory for very large GPU runs); with FSDP2 the fp32 master shards are already divided
by the number of ranks, which is the usual answer for our sizes.
"""

from __future__ import annotations

import logging

import torch

from rlhfkit.config.dtypes import DTYPES, dtype_flag_name, run_dtype  # noqa: F401 - the one table

log = logging.getLogger(__name__)



def parse_dtype(name: str) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' -> torch dtype (flag `--param_dtype`)."""
    if name not in DTYPES:
        raise ValueError(f"--param_dtype must be one of bf16, fp16, fp32, got {name!r}")
    return DTYPES[name]


def compute_dtype_for(param_dtype: torch.dtype, device: torch.device,
                      cpu_low_precision: bool = False) -> torch.dtype:
    """The dtype forward/backward run in: `param_dtype`, except fp32 on CPU unless asked."""
    if device.type == "cpu" and param_dtype != torch.float32 and not cpu_low_precision:
        log.debug("--param_dtype %s on CPU: computing in fp32 (low-precision CPU compute is slow); "
                 "pass cpu_low_precision=True to keep %s", param_dtype, param_dtype)
        return torch.float32
    return param_dtype


class DynamicLossScaler:
    """Loss scale S for fp16: grow x2 every `growth_interval` finite steps, halve on overflow."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 min_scale: float = 1.0) -> None:
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.min_scale, self.scale / 2.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
