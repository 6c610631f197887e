"""Whether the builtin engine can run a model, from its Hugging Face config alone (no weights read).

    builtin_support(config, max_model_len=None) -> None (it can) or the reason it cannot

This is not a second list of families: it runs the checks the engine itself makes when it is built,
in the order it meets them, and reports the first refusal:

    ModelSpec.from_hf_config   the model family (`model_type`), the MLP activation, ... (model/spec.py)
    rope_table_set             the rotary embedding types, at the engine's max_model_len (model/rope.py)

so a family the engine learns is supported here the moment its own checks accept it. The engine's
advice to pick another `--rollout_engine` is left out of the reason: the caller (rollout/choice.py)
says what runs instead.
"""

from __future__ import annotations

import copy
import re
from typing import Any

# the engine's max_model_len when none is given (BuiltinEngineConfig.max_model_len's default)
DEFAULT_MAX_MODEL_LEN = 2048
# the errors a check raises for a config it cannot take (a config lacking a field the family needs included)
_REFUSALS = (ValueError, KeyError, AttributeError, TypeError, NotImplementedError)
_ADVICE = re.compile(r";\s*use --rollout_engine\b.*$", re.DOTALL)


def _reason(err: Exception) -> str:
    text = " ".join(_ADVICE.sub("", str(err)).split())  # one line
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"


def builtin_support(config: Any, max_model_len: int | None = None) -> str | None:
    """None when the builtin engine accepts `config` (a transformers `PretrainedConfig`) with
    `max_model_len` tokens per sequence (default: the engine's, min(max_position_embeddings, 2048));
    else why it does not, as one line."""
    import torch

    from rlhfkit.rollout.builtin.model.rope import rope_table_set
    from rlhfkit.rollout.builtin.model.spec import ModelSpec

    config = copy.deepcopy(config)  # from_hf_config may fill a VLM's text config in place
    try:
        spec = ModelSpec.from_hf_config(config)
        length = max_model_len or min(spec.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        rope_table_set(config, spec, length, torch.float32, torch.device("cpu"))
    except _REFUSALS as e:
        return _reason(e)
    return None
