"""LoRA adapters (peft): attach them for training and merge them into a base model.

LoRA (low-rank adaptation) replaces a frozen weight W by W + (alpha / r) * B A with
A in R^{r x in}, B in R^{out x r}; merging writes that sum back into W, so the merged model gives the
adapted model's outputs with no adapter at run time.

    apply_lora(model, cfg)                       --lora_rank/--lora_alpha/--target_modules/--lora_dropout
    lora_merge.merge_lora(model_path, lora_path, out, ...)  the `lora_combiner` CLI

`--target_modules all-linear` means every linear layer of the backbone: the output layer (`lm_head`)
and a value/reward head are excluded; a value head is trained in full (peft `modules_to_save`).
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.config.configs import ModelConfig
from rlhfkit.optional import require

OUTPUT_LAYER_NAMES = ("lm_head",)


def linear_module_names(model: torch.nn.Module, exclude: tuple[str, ...] = ()) -> list[str]:
    """Sorted names of the linear layers, skipping `exclude` and the output layer: distinct leaf names
    (`q_proj`), and a linear layer's full name where its leaf name also names a module that is not linear
    (a VLM's vision merger `mlp.0` beside the vision tower's `blocks.0`), since peft matches by suffix."""
    skip = set(OUTPUT_LAYER_NAMES) | set(exclude)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear: dict[str, list[str]] = {}
    other: set[str] = set()
    for full_name, module in model.named_modules():
        leaf = full_name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and module is not out_emb and leaf not in skip:
            linear.setdefault(leaf, []).append(full_name)
        else:
            other.add(leaf)
    if not linear:
        raise ValueError("--target_modules all-linear: the model has no linear layers to adapt")
    if _has_fused_experts(model):  # peft maps MLP names onto the routed experts' 3-D weights: leave them out
        return sorted(full for leaf, fulls in linear.items() if leaf not in MLP_NAMES for full in fulls)
    names = set()
    for leaf, fulls in linear.items():
        names |= set(fulls) if leaf in other else {leaf}
    return sorted(names)


MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def _has_fused_experts(model: torch.nn.Module) -> bool:
    """Whether the model keeps routed experts as 3-D weights (transformers 5's MoE layers). peft 0.21 turns
    target names such as `down_proj` into adapters of those experts, which the RL weight sync cannot
    merge; all-linear then names the attention (and other non-MLP) linear layers in full."""
    return any(p.dim() == 3 for _, p in model.named_parameters())


def check_no_expert_adapters(model: torch.nn.Module) -> None:
    """Refuse LoRA adapters on routed experts (see `_has_fused_experts`), naming the flag."""
    wrapped = sorted({n.split(".lora_")[0] for n, _ in model.named_parameters() if ".experts." in n + "."
                      and ".lora_" in n})
    if wrapped:
        raise ValueError(f"--target_modules: LoRA on routed experts ({wrapped[0]}, ...) is not supported (an engine "
                         "cannot merge it); use all-linear (the attention layers of an MoE model) or attention "
                         "module names such as q_proj k_proj v_proj o_proj")


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
    require("peft", "--lora_rank")
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
    require("peft", "--lora_rank")
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(model, cfg, modules_to_save, causal))
    check_no_expert_adapters(model)
    return model


# ----------------------------------------------------------------------------- weight sync of a LoRA policy

_LORA_PARTS = ((".base_layer.weight", "w"), (".lora_A.default.weight", "a"), (".lora_B.default.weight", "b"))


def lora_layers(model: torch.nn.Module) -> dict[str, tuple[float, bool]]:
    """`{module name: (scaling alpha / r, fan_in_fan_out)}` of the model's LoRA layers (empty without peft
    adapters). A DoRA adapter is refused: its merge is not W + s B A."""
    out: dict[str, tuple[float, bool]] = {}
    for name, m in model.named_modules():
        scaling = getattr(m, "scaling", None)
        if isinstance(scaling, dict) and "default" in scaling and hasattr(m, "lora_A"):
            if (getattr(m, "use_dora", None) or {}).get("default"):
                raise ValueError(f"weight sync of a DoRA adapter ({name}) is not supported; use plain LoRA")
            out[name] = (float(scaling["default"]), bool(getattr(m, "fan_in_fan_out", False)))
    return out


def _base_name(name: str) -> str | None:
    """A peft parameter name -> the base model's (None: a copy peft keeps of a module it trains in full)."""
    if ".original_module." in name:
        return None
    return name.replace(".modules_to_save.default.", ".").replace(".base_layer.", ".").removeprefix("base_model.model.")


def merged_lora_weights(named: Any, layers: dict[str, tuple[float, bool]]) -> Any:
    """(name, full tensor) pairs of a peft model, in `named_parameters` order -> the base model's names
    with each LoRA layer's update merged (W + s B A, in fp32, then W's dtype): what an inference engine
    that knows only the base architecture loads. A layer's three tensors may arrive in any buckets."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        prefix = kind = None
        for suffix, k in _LORA_PARTS:
            if name.endswith(suffix) and name[:-len(suffix)] in layers:
                prefix, kind = name[:-len(suffix)], k
                break
        if prefix is None:
            if ".lora_" in name:
                raise ValueError(f"weight sync: LoRA parameter {name} is of a kind rlhfkit does not merge "
                                 "(only linear layers' lora_A / lora_B of the default adapter)")
            base = _base_name(name)
            if base is not None:
                yield base, t
            continue
        parts = pending.setdefault(prefix, {})
        parts[kind] = t
        if len(parts) == 3:
            scaling, fan_in_fan_out = layers[prefix]
            delta = parts["b"].float() @ parts["a"].float()
            w = parts["w"]
            yield _base_name(prefix + ".weight"), (w.float() + scaling * (delta.t() if fan_in_fan_out else delta)
                                                   ).to(w.dtype)
            del pending[prefix]
    if pending:
        raise RuntimeError(f"weight sync: LoRA layers missing a part: {sorted(pending)[:3]}")
