"""Reward and critic models: a Hugging Face backbone plus a linear value head.

    input_ids [B, L] -> backbone (model.model) -> hidden [B, L, H] -> head [1, H], no bias -> values [B, L]
    reward = values at the last non-padding token (`reward_at_last_token`; left or right padding)

The model class is the architecture's own `AutoModelForSequenceClassification` class (e.g.
`LlamaForSequenceClassification`, whose backbone is `model` and whose head is `score`) with
`forward` replaced to return per-token values. So a saved reward model is an ordinary
sequence-classification checkpoint: `AutoModelForSequenceClassification.from_pretrained(path,
num_labels=1)` loads the same weights and gives the same score (it takes the rightmost token that is
not `pad_token_id`; we take the last token of `attention_mask`, which also works when pad == eos).

Scoring in plain transformers. rlhfkit scores `encode(prompt, start=True) + encode(response) + [eos]`
(the BOS the tokenizer adds, once; the EOS appended as in training:
`rlhfkit.data.items.join_prompt_response`). A saved reward or critic model therefore carries a tokenizer
that gives those ids when plain transformers calls it on the text the docs name
(`rlhfkit.models.scoring_tokenizer`: prompt + response text, or for a model trained with
`--apply_chat_template` the saved tokenizer's `apply_chat_template(messages, tokenize=False)`), and whose
pad token is not EOS, with `config.pad_token_id` set to it, so that the rightmost non-pad token that
`*ForSequenceClassification` scores is the last real one; `config.problem_type = "regression"` makes
`pipeline("text-classification")` return the raw score instead of its sigmoid. Then

    AutoModelForSequenceClassification.from_pretrained(d)(**AutoTokenizer.from_pretrained(d)(texts,
        padding=True, return_tensors="pt")).logits[:, 0]

equals rlhfkit's rewards for `texts` (right padding, as the tokenizer pads; raw, not normalised).
rlhfkit itself encodes without the tokenizer's post-processing, so the saved tokenizer changes none of
its scores.

A head named by `value_head_prefix` other than `score` (older OpenRLHF reward models use
`value_head`) is supported; as in OpenRLHF, a prefix stored in the model's config.json wins over the
argument. The config also carries `normalize_reward`, `mean` and `std`: with normalisation on, the
model returns (v - mean) / std (OpenRLHF stores the training rewards' statistics there for
--normalize_reward).

Positions are computed from `attention_mask` (cumsum - 1), so a sequence gets the same values
whatever its padding. Values at padding positions are 0.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import torch

from rlhfkit.config.configs import ModelConfig
from rlhfkit.fileio import new_staging_dir, publish_staged
from rlhfkit.models.loader import (check_model_dir, finish_model, pretrained_kwargs, resolve_dtype,
                                   weight_file_keys)
from rlhfkit.models.scoring_tokenizer import appends_eos, scoring_tokenizer  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

REWARD_CONFIG_KEYS = ("value_head_prefix", "normalize_reward", "mean", "std")
_CLASS_CACHE: dict[type, type] = {}
_PICKLE_SUFFIX = "_ValueModel"


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 on the first real token of each row: cumsum(mask) - 1, >= 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the last 1 in each row of `attention_mask` [B, L] (left or right padding)."""
    length = attention_mask.shape[-1]
    return length - 1 - attention_mask.long().flip(-1).argmax(-1)


def reward_at_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values [B, L] -> [B]: the value at each row's last non-padding token."""
    idx = last_token_index(attention_mask).to(values.device)
    return values.gather(1, idx.unsqueeze(1)).squeeze(1)


class ValueHeadMixin:
    """Mixed in before a `*ForSequenceClassification` class: per-token values instead of pooled logits."""

    config: Any
    base_model_prefix: str

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # type: ignore[call-arg]
        prefix = getattr(config, "value_head_prefix", "score")
        if not isinstance(getattr(self, "score", None), torch.nn.Linear):
            raise ValueError(f"{type(self).__name__} has no linear `score` head; this architecture is not supported "
                             "as a reward/critic model")
        if prefix != "score":  # rename the head so that checkpoint keys read `<prefix>.weight`
            head = self.score
            del self.score
            setattr(self, prefix, head)

    # methods, not properties: a property named like the head (`value_head`) would shadow the module
    def get_value_head(self) -> torch.nn.Linear:
        return getattr(self, self.config.value_head_prefix)

    def get_backbone(self) -> torch.nn.Module:
        return getattr(self, self.base_model_prefix)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """input_ids [B, L] -> values [B, L] (float32; 0 at padding; normalised if config.normalize_reward)."""
        if position_ids is None and attention_mask is not None:
            position_ids = positions_from_mask(attention_mask)
        kwargs.setdefault("use_cache", False)
        hidden = self.get_backbone()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **kwargs).last_hidden_state
        values = self.get_value_head()(hidden).squeeze(-1).float()
        if getattr(self.config, "normalize_reward", False):
            values = (values - float(self.config.mean)) / float(self.config.std)
        if attention_mask is not None:
            values = values.masked_fill(attention_mask == 0, 0.0)
        return values


def value_model_class(config: Any) -> type:
    """The architecture's sequence-classification class with `ValueHeadMixin` in front (same name)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    try:
        base = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"model type {config.model_type!r} has no sequence-classification class in transformers; "
                         "it cannot be used as a reward/critic model") from None
    if base not in _CLASS_CACHE:
        # __name__ is the stock class's, so config.json's `architectures` names it; __qualname__ and
        # __module__ point here, so pickle finds this class (through the module __getattr__ below).
        cls = type(base.__name__, (ValueHeadMixin, base), {"__module__": __name__})
        cls.__qualname__ = base.__name__ + _PICKLE_SUFFIX
        _CLASS_CACHE[base] = cls
    return _CLASS_CACHE[base]


def __getattr__(name: str) -> type:
    """`rlhfkit.models.value.<SeqClsName>_ValueModel`: the dynamic class, built on first use (unpickling)."""
    if not name.endswith(_PICKLE_SUFFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    base_name = name[: -len(_PICKLE_SUFFIX)]
    for model_type, cls_name in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.items():
        if cls_name == base_name:
            return value_model_class(CONFIG_MAPPING[model_type]())
    raise AttributeError(f"no sequence-classification class named {base_name!r}")


def checkpoint_keys(path: str) -> set[str]:
    """Parameter names stored in a model directory (safetensors, sharded or not, or pytorch_model.bin)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    keys = weight_file_keys(path, "model.safetensors", "pytorch_model.bin")
    if keys is not None:
        return keys
    raise FileNotFoundError(f"{path!r} has no model.safetensors[.index.json] or pytorch_model.bin")


def init_value_head_(model: Any) -> None:
    """Head ~ N(0, 1/(H+1)) as OpenRLHF initialises a fresh value head."""
    head = model.get_value_head()
    with torch.no_grad():
        head.weight.normal_(mean=0.0, std=1.0 / math.sqrt(head.in_features + 1))


def _value_config(path: str, value_head_prefix: str, normalize_reward: bool) -> Any:
    """The model's config with the reward keys filled in (mean 0 / std 1 when not stored)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    stored = reward_settings(path)
    config.value_head_prefix = stored.get("value_head_prefix") or value_head_prefix
    config.num_labels = 1
    config.normalize_reward = bool(normalize_reward)
    config.mean = float(stored["mean"]) if stored.get("mean") is not None else 0.0
    config.std = float(stored["std"]) if stored.get("std") is not None else 1.0
    if normalize_reward:
        if not config.std > 0:
            raise ValueError(f"--normalize_reward: config.json of {path!r} has std={config.std}; it must be > 0")
        if stored.get("mean") is None or stored.get("std") is None:
            logger.warning("--normalize_reward: %s stores no reward mean/std; using mean=0 std=1", path)
    return config


def load_value_model(path: str, value_head_prefix: str = "score", init_value_head: bool = False,
                     dtype: str | torch.dtype = torch.float32, normalize_reward: bool = False,
                     attn_implementation: str = "sdpa", device: str | torch.device | None = None,
                     cfg: ModelConfig | None = None, flag: str = "--pretrain",
                     allow_missing_head: bool = False) -> Any:
    """Load a reward or critic model from a local directory (or a hub id: `rlhfkit.models.hub`).

    path: a reward model (head stored) or a causal LM / base model (then `init_value_head=True`).
    init_value_head: re-initialise the head (new reward model / critic from a policy).
    cfg: optional training settings (gradient checkpointing, LoRA with the head trained in full,
        4-bit); its `attn_implementation` is used instead of the argument when given.
    allow_missing_head: keep a freshly initialised head when the checkpoint has none (the caller
        fills it, e.g. from a LoRA adapter). Otherwise a missing head is an error.
    """
    path = check_model_dir(path, flag)
    config = _value_config(path, value_head_prefix, normalize_reward)
    prefix = config.value_head_prefix
    has_head = f"{prefix}.weight" in checkpoint_keys(path)
    if not (has_head or init_value_head or allow_missing_head):
        raise ValueError(f"{flag} {path!r} has no value head '{prefix}.weight' (is it a reward model? "
                         "pass --value_head_prefix with the head's name)")
    model_cfg = cfg or ModelConfig(attn_implementation=attn_implementation)
    kw = pretrained_kwargs(model_cfg, resolve_dtype(dtype, "dtype"), device, [prefix], path=path)
    model = value_model_class(config).from_pretrained(path, config=config, **kw)
    if init_value_head:
        init_value_head_(model)
    if cfg is None:
        return model.to(device) if device is not None else model
    return finish_model(model, cfg, device, modules_to_save=[prefix], causal=False)


def value_model_from(model: torch.nn.Module, value_head_prefix: str = "score", cfg: ModelConfig | None = None) -> Any:
    """A critic on a causal LM given as a module (rlhfkit.models.given), as `load_value_model(path,
    init_value_head=True, cfg=cfg)` makes one from a directory: the architecture's value class holding
    `model`'s backbone tensors (taken, not copied: pass a copy the critic may train) and a fresh head."""
    import copy

    config = copy.deepcopy(model.config)
    config.value_head_prefix, config.num_labels, config.normalize_reward = value_head_prefix, 1, False
    config.mean, config.std = 0.0, 1.0
    with torch.random.fork_rng(devices=[]):  # its random initial weights are replaced: the seeded generator
        out = value_model_class(config)(config)  # moves only for the head, as when loading from a directory
    missing, _ = out.load_state_dict(model.state_dict(), strict=False, assign=True)
    if set(missing) - {f"{value_head_prefix}.weight", f"{value_head_prefix}.bias"}:
        raise ValueError(f"the given {type(model).__name__} lacks backbone weights of "
                         f"{type(out).__name__}: {sorted(missing)[:3]}")
    with torch.no_grad():  # what loading a checkpoint without the head draws for it (transformers
        out.get_value_head().weight.normal_()  # initialises missing weights), so the generator is where
    init_value_head_(out)                      # load_value_model leaves it
    return finish_model(out, cfg, None, modules_to_save=[value_head_prefix], causal=False) if cfg else out


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def update_reward_config(config: Any, tokenizer: Any = None, mean: float | None = None,
                         std: float | None = None, normalize_reward: bool | None = None) -> None:
    """Write the reward keys into `config`; with a (scoring) tokenizer, its pad_token_id too."""
    config.value_head_prefix = getattr(config, "value_head_prefix", "score")
    config.num_labels = 1
    config.problem_type = "regression"  # pipeline("text-classification"): the raw score, no sigmoid
    if normalize_reward is not None:
        config.normalize_reward = bool(normalize_reward)
    config.normalize_reward = bool(getattr(config, "normalize_reward", False))
    if mean is not None:
        config.mean = float(mean)
    if std is not None:
        if not std > 0:
            raise ValueError(f"reward std must be > 0 to be stored for --normalize_reward, got {std}")
        config.std = float(std)
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id


def save_value_model(model: Any, path: str, tokenizer: Any = None, mean: float | None = None,
                     std: float | None = None, normalize_reward: bool | None = None,
                     state_dict: dict[str, torch.Tensor] | None = None, is_main_process: bool = True,
                     chat: bool | None = None) -> str:
    """Save a reward/critic model so that `AutoModelForSequenceClassification` loads it and, with the
    saved tokenizer (`scoring_tokenizer(tokenizer)`), scores text as rlhfkit does.

    config.json gets `value_head_prefix`, `normalize_reward`, `mean`, `std`, `pad_token_id` and
    `problem_type`.
    `chat`: trained on rows rendered by the chat template (`scoring_tokenizer`; None: as `tokenizer` says).
    `state_dict` lets a sharded backend pass the gathered full weights. A peft (LoRA) model saves
    its adapter (with the head, trained in full) plus this config.json; `lora_combiner --is_rm`
    merges it.
    """
    base = model.get_base_model() if _is_peft(model) else model
    tokenizer = scoring_tokenizer(tokenizer, chat)
    update_reward_config(base.config, tokenizer, mean, std, normalize_reward)
    if not is_main_process:
        return path
    stage = new_staging_dir(path)  # published whole (rlhfkit.fileio): never a mix of old and new files
    if _is_peft(model):
        model.save_pretrained(stage)
        base.config.save_pretrained(stage)
    else:
        model.save_pretrained(stage, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    publish_staged(stage, path)
    return path


def reward_settings(path: str) -> dict[str, Any]:
    """The reward keys stored in `path`/config.json (empty when none)."""
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        return {}
    with open(f) as fh:
        data = json.load(fh)
    return {k: data[k] for k in REWARD_CONFIG_KEYS if k in data}
