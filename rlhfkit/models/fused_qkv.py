"""k and v projected by one GEMM in the attention layers of Llama-family models, on the GPU.

Hugging Face's Llama, Qwen2/3, Mistral and Gemma attention projects its input three times:
`q_proj(x)`, `k_proj(x)`, `v_proj(x)`. With grouped-query attention the k and v projections are
narrow (two kv heads of 64 at the Qwen2-0.5B shape: N = 128), and in the backward their weight
gradients run split-K with a reduce kernel each.

`fuse_qkv(model)` changes the class of each such k_proj into `FusedKProj`, which multiplies x by
cat(Wk, Wv) (and adds cat(bk, bv)) and hands the v slice to v_proj (`StashedProj`), which returns it
when called next with the same x. Parameters, their names, the state dict and the checkpoints stay
those of the two layers; the concatenated weight (0.2 MB per layer at that shape) is built in each
forward and its gradient split back by autograd. A v_proj called with another input, or alone,
computes its own GEMM. Under peft LoRA the base layers are fused (peft calls `base_layer(x)` with
the input the adapters see).

q keeps its own GEMM: with q in it, the backward has to assemble the fused gradient from q's rotary
backward, and the one kernel inductor makes of that (index arithmetic per element over three slices)
costs more than the GEMMs save (bench/probe/qkv_layer.py compares the three layouts).

Left as they are: layers whose weights are DTensors in the forward (tensor parallel), whose two
layers differ in input size, dtype or in having a bias, and every layer on the CPU (there the
unfused GEMMs keep the numbers of the reference runs bit-identical).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

ENABLED = True  # bench A/B switch (bench/train_throughput.py's _nofuse variants)
DEVICE_TYPES = ("cuda",)  # where the fused GEMM runs (tests add "cpu")


def _base(module: nn.Module | None) -> nn.Module | None:
    """The plain linear layer behind a peft LoRA wrapper (its `base_layer`), or the module itself."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) else module


class StashedProj(nn.Linear):
    """v_proj whose output the k_proj next to it may already have computed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash = self._kv_stash
        if stash:
            src, out = stash.pop()
            if src is x:
                return out
        return F.linear(x, self.weight, self.bias)


class FusedKProj(nn.Linear):
    """k_proj computing k and v in one GEMM; the v slice goes to its `StashedProj` peer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (v,) = self._kv_peer
        if not ENABLED or x.device.type not in DEVICE_TYPES or isinstance(self.weight, DTensor) \
                or isinstance(v.weight, DTensor):
            return F.linear(x, self.weight, self.bias)
        b = None if self.bias is None else torch.cat((self.bias, v.bias))
        k_out, v_out = F.linear(x, torch.cat((self.weight, v.weight)), b).split(
            (self.out_features, v.out_features), dim=-1)
        v._kv_stash.clear()  # one pending output at most
        v._kv_stash.append((x, v_out))
        return k_out


def _fusable(k: nn.Module | None, v: nn.Module | None) -> bool:
    if not all(type(m) in (nn.Linear, FusedKProj, StashedProj) for m in (k, v)):
        return False
    return len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in (k, v)}) == 1  # type: ignore[union-attr]


def fuse_qkv(model: nn.Module) -> int:
    """Fuse the k/v projections of every attention layer that has q_proj, k_proj and v_proj (see the
    module docstring); returns how many layers were fused. Idempotent."""
    n = 0
    for module in model.modules():
        if _base(getattr(module, "q_proj", None)) is None:
            continue
        k, v = (_base(getattr(module, name, None)) for name in ("k_proj", "v_proj"))
        if not _fusable(k, v):
            continue
        k.__class__ = FusedKProj  # type: ignore[union-attr]
        v.__class__ = StashedProj  # type: ignore[union-attr]
        v._kv_stash = []  # type: ignore[union-attr]
        k._kv_peer = (v,)  # type: ignore[union-attr]  # in a tuple: not registered as a submodule
        n += 1
    return n
