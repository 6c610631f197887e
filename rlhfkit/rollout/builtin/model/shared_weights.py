"""The builtin engine sharing a module's weights instead of copying them (train_ppo's `--engine_weights`,
batch_inference): `adopt_parameters(model, dtype, device)` builds the engine's tensors from an HF module and
makes each of its parameters that lands whole in one of them (or in a row block of a fused one: q, k and v
of `qkv`, gate and up of `gate_up`) a view of it, so one copy serves training and generation; a peft LoRA
model's base is shared alike and its adapters are applied unmerged (`LayerWeights.lora`); a 4-bit (QLoRA) base
stays 4-bit, dequantized a layer at a time into a scratch all layers share (model/quantized.py).
`sharing_blocker(model)` says beforehand when that cannot be done; `weight_name` maps a parameter's name to
the base model's name the engine shares it under.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from rlhfkit.rollout.builtin.model.families import EXPERT_RE
from rlhfkit.models.loader import is_4bit
from rlhfkit.rollout.builtin.model.quantized import QuantPart, quantized_shape
from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.rollout.builtin.model.weights import (ALL_ROWS, LAYER_RE, Coverage, LoraPack, LoraPart,
                                                   ModelWeights, allocate_weights, copy_into, keyed_targets,
                                                   normalized_name, part_bounds)

_LORA_RE = re.compile(r"^(.+)\.lora_([AB])\.default\.weight$")


def _peft_base_name(name: str) -> str:
    """A peft model's parameter name -> the base model's (`base_model.model.` and `.base_layer` dropped)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _lora_place(spec: ModelSpec, module: str) -> tuple[int, str, int, int] | str:
    """(layer, engine tensor, first row, end row) a LoRA adapter on `module` (a peft module name) adds to,
    or why the engine cannot serve it unmerged."""
    name = normalized_name(_peft_base_name(module) + ".weight")
    m = LAYER_RE.match(name)
    entry = spec.family.names.get(m.group(2)) if m is not None else None
    if m is None or entry is None or EXPERT_RE.match(m.group(2)):
        return f"a LoRA adapter on {module}"
    attr, part, _ = entry
    if part == "T":
        return f"a LoRA adapter on the transposed {module}"
    if part is None or part == "all":
        return int(m.group(1)), attr, 0, -1
    return (int(m.group(1)), attr, *part_bounds(spec, attr, part))


def weight_name(name: str) -> str | None:
    """A module parameter's normalized base-model name as `adopt_parameters` shares it (None: a peft LoRA
    adapter, which the engine applies unmerged)."""
    return None if _LORA_RE.match(name) else normalized_name(_peft_base_name(name))


def sharing_blocker(model: torch.nn.Module, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None) -> str | None:
    """Why an engine of `dtype` on `device` cannot take `model`'s weights over (`adopt_parameters`): a
    vision-language model (its tower is not shared), weights of another dtype or device type, a peft LoRA
    model's adapters it cannot apply unmerged, a module peft trains in full; None if it can. Changes nothing."""
    from rlhfkit.models.lora import lora_layers
    from rlhfkit.models.vlm import is_vlm_config

    if is_vlm_config(model.config):
        return "a vision-language model's tower is not shared"
    if dtype is not None:
        have = {p.dtype for p in model.parameters() if not is_4bit(p)}
        if have != {dtype}:
            return (f"the policy's weights are {'/'.join(sorted(str(d).removeprefix('torch.') for d in have))}, "
                    f"the engine's {str(dtype).removeprefix('torch.')}")
    if device is not None and any(p.device.type != torch.device(device).type for p in model.parameters()):
        return f"the weights are not all on {device}"
    spec = ModelSpec.from_hf_config(model.config)
    for name, p in model.named_parameters():
        if ".modules_to_save." in name or ".original_module." in name:
            return f"a module trained in full beside LoRA ({name})"
        if ".lora_" in name and not _LORA_RE.match(name):
            return f"a LoRA parameter of another kind ({name})"
        if is_4bit(p) and isinstance(_lora_place(spec, _peft_base_name(name).removesuffix(".weight")), str):
            return f"a 4-bit weight outside the attention and dense MLP projections ({name})"
    for module, (_, fan_in_fan_out) in lora_layers(model).items():
        place = _lora_place(spec, module)
        if isinstance(place, str):
            return place
        if fan_in_fan_out:
            return f"a fan-in-fan-out LoRA layer ({module})"
    return None


def _materialize_part(weights: ModelWeights, name: str | None, device: torch.device) -> None:
    """Allocate on `device` the meta tensors of the part of `weights` that HF parameter `name` fills: its
    layer's, or the embeddings, final norm and head; `name` None: every part still on the meta device."""
    def real(t: torch.Tensor | None) -> torch.Tensor | None:
        return torch.empty(t.shape, dtype=t.dtype, device=device) if t is not None and t.is_meta else t

    m = LAYER_RE.match(normalized_name(name)) if name is not None else None
    layers = weights.layers if name is None else [weights.layers[int(m.group(1))]] if m is not None else []
    if name is None or m is None:
        tied = weights.lm_head is weights.embed
        embed, final_norm = real(weights.embed), real(weights.final_norm)
        assert embed is not None and final_norm is not None
        weights.embed, weights.final_norm = embed, final_norm
        if tied:
            weights.lm_head = weights.embed
        else:
            lm_head = real(weights.lm_head)
            assert lm_head is not None
            weights.lm_head = lm_head
    for layer in layers:
        for k, t in layer.named_tensors().items():
            setattr(layer, k, real(t))


def adopt_parameters(model: torch.nn.Module, dtype: torch.dtype,
                     device: torch.device) -> tuple[ModelSpec, ModelWeights, frozenset[str]]:
    """Like `load_from_hf_model`, then each parameter of `model` that lands whole in one engine tensor (or a
    row block of a fused one: q, k and v in `qkv`, gate and up in `gate_up`) of its dtype and device becomes a
    view of it (`param.data = view`): the engine and the module share one copy, and an optimizer's in-place
    step is what the engine serves next. A peft LoRA model's base weights are shared alike and its adapters
    are applied unmerged (`LayerWeights.lora`: packed copies of the trainer's tensors, refreshed at each weight
    update; `sharing_blocker` says when not).
    Returns the spec, the weights and the normalized base-model names the engine shares (a LoRA layer's
    name among them: a weight sync must not write its merged weight); the others (transposed, sliced or
    cast on their way in, or placed twice) are still copied by a weight sync. The module's own storage of
    a shared parameter is freed once nothing else holds it. Unsharded engines of a plain (not DTensor)
    module only."""
    from torch.distributed.tensor import DTensor

    from rlhfkit.models.lora import lora_layers

    why = sharing_blocker(model)
    if why is not None:
        raise ValueError(f"the engine cannot share these weights: {why}")
    spec = ModelSpec.from_hf_config(model.config)
    params = dict(model.named_parameters())  # tied parameters once
    for peft_name, param in params.items():
        if isinstance(param, DTensor):
            raise ValueError(f"adopt_parameters: {peft_name} is a DTensor (a sharded module cannot share its "
                             "weights with one engine)")
        if _LORA_RE.match(peft_name) and (param.dtype != dtype or param.device != device):
            raise ValueError(f"the engine cannot share these weights: the adapter {peft_name} is {param.dtype} on "
                             f"{param.device}, the engine's {dtype} on {device}")
    named = [(n, p) for n, p in params.items() if not _LORA_RE.match(n)]
    # allocated where each part is first filled (the embeddings and head, then layer by layer), and each
    # shared parameter's own storage freed as it moves in: one copy and one layer at the most, not two copies
    weights = allocate_weights(spec, {_peft_base_name(n) for n, _ in named}, dtype, torch.device("meta"))
    coverage = Coverage()
    shared: set[str] = set()
    quantized = [(n, p) for n, p in named if is_4bit(p)]
    if quantized:
        _adopt_quantized(weights, spec, quantized, device, coverage, shared)
    with torch.no_grad():
        for peft_name, param in named:
            if is_4bit(param):
                continue
            name = _peft_base_name(peft_name)
            _materialize_part(weights, name, device)
            found = keyed_targets(weights, spec, name)
            for dst, index, _ in found:
                copy_into(dst, param.detach()[index], name)
            coverage.add(name, found)
            if len(found) == 1:
                dst, index, _ = found[0]
                if (index == ALL_ROWS and dst.shape == param.shape and dst.dtype == param.dtype
                        and dst.device == param.device and dst.is_contiguous()):
                    param.data = dst
                    shared.add(normalized_name(name))
    _materialize_part(weights, None, device)  # any part no parameter filled (coverage says which)
    coverage.check(spec, weights)
    parts: dict[tuple[int, str], list[LoraPart]] = {}
    for module, (scale, _) in lora_layers(model).items():
        place = _lora_place(spec, module)
        assert not isinstance(place, str)  # sharing_blocker checked every adapter
        li, attr, start, end = place
        a, b = params[f"{module}.lora_A.default.weight"], params[f"{module}.lora_B.default.weight"]
        end = getattr(weights.layers[li], attr).shape[0] if end < 0 else end
        parts.setdefault((li, attr), []).append(LoraPart(start, end, a.detach(), b.detach(), scale))
        shared.add(normalized_name(_peft_base_name(module) + ".weight"))
    for (li, attr), ps in parts.items():
        weights.layers[li].lora[attr] = LoraPack.of(ps, getattr(weights.layers[li], attr).shape[0])
    return spec, weights, frozenset(shared)


def _adopt_quantized(weights: ModelWeights, spec: ModelSpec, quantized: Sequence[tuple[str, torch.Tensor]],
                     device: torch.device, coverage: Coverage, shared: set[str]) -> None:
    """Point each engine tensor that 4-bit weights fill at a scratch every layer shares (one per tensor and
    shape) and record the weights as its `QuantPart`s (model/quantized.py): nothing is copied."""
    scratch: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    for peft_name, param in quantized:
        if param.device.type != device.type:
            raise ValueError(f"the engine cannot share these weights: the 4-bit {peft_name} is on {param.device}, "
                             f"the engine on {device}")
        name = _peft_base_name(peft_name)
        place = _lora_place(spec, name.removesuffix(".weight"))
        assert not isinstance(place, str)  # sharing_blocker checked every 4-bit weight
        li, attr, start, end = place
        layer = weights.layers[li]
        full = getattr(layer, attr)
        end = full.shape[0] if end < 0 else end
        if tuple(quantized_shape(param)) != (end - start, full.shape[1]):
            raise ValueError(f"weight {peft_name!r}: 4-bit shape {tuple(quantized_shape(param))} does not match "
                             f"the engine's {(end - start, full.shape[1])}")
        if full.is_meta:
            key = (attr, tuple(full.shape))
            if key not in scratch:
                scratch[key] = torch.empty(full.shape, dtype=full.dtype, device=device)
            setattr(layer, attr, scratch[key])
        layer.quant.setdefault(attr, []).append(QuantPart(start, end, param.data, param.quant_state))  # type: ignore[attr-defined]
        coverage.filled[f"{li}.{attr}"] = coverage.filled.get(f"{li}.{attr}", 0) + (end - start) * full.shape[1]
        coverage.names.add(normalized_name(name))
        shared.add(normalized_name(name))
