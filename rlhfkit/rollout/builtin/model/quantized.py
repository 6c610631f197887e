"""The builtin engine serving a 4-bit base (QLoRA: `--load_in_4bit`) that the trainer holds.

A policy loaded with `--load_in_4bit` keeps each linear layer's frozen weight as bitsandbytes NF4 (a packed
`uint8` tensor and its `QuantState`: 4 bits and about 0.13 bits of scales a value). The engine takes those
tensors over as they are (no bf16 copy of the model) and dequantizes one layer at a time into four
scratch tensors that every layer's `qkv`, `o`, `gate_up` and `down` name (`LayerWeights.quant`): before a
layer runs, `dequantize_layer` writes its q, k, v (gate, up) into row blocks of the fused scratch, and the
layer's GEMMs and unmerged LoRA adapters run as for a bf16 model. The scratch costs one layer's bf16
projections; the dequantization reads 0.5 bytes and writes 2 bytes a weight per forward pass.

    (which parameters are 4-bit: rlhfkit.models.loader.is_4bit)
    QuantPart                    one 4-bit weight: its rows of a fused engine tensor
    dequantize_layer(layer)      fill the layer's scratch from its 4-bit weights (before the layer runs)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def quantized_shape(param: torch.Tensor) -> torch.Size:
    """The `[out, in]` shape the 4-bit `param` stands for."""
    return param.quant_state.shape  # type: ignore[attr-defined]


@dataclass
class QuantPart:
    """A 4-bit weight on rows `start:end` of a fused engine tensor (the trainer's own packed tensor and
    its `QuantState`, never copied)."""

    start: int
    end: int
    packed: torch.Tensor
    state: Any


@torch.compiler.disable  # bitsandbytes' wrapper reads its QuantState in Python: run it as it is
def dequantize_layer(layer: Any) -> None:
    """Write each of `layer.quant`'s 4-bit weights, in the compute dtype, into its rows of the layer's
    scratch tensor (`layer.qkv`, ...). On CUDA the kernel writes into the rows themselves (capturable in a
    CUDA graph: no host sync); elsewhere the dequantized copy is copied in."""
    import bitsandbytes.functional as bnb_f

    with torch.no_grad():
        for attr, parts in layer.quant.items():
            dst = getattr(layer, attr)
            for p in parts:
                rows = dst[p.start:p.end]
                if rows.is_cuda and rows.dtype == p.state.dtype:
                    bnb_f.dequantize_4bit(p.packed, p.state, out=rows)
                else:
                    rows.copy_(bnb_f.dequantize_4bit(p.packed, p.state))
