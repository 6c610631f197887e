"""Models and a tokenizer handed to a run as objects (the Python API), in place of what the directories of
--pretrain and --ref_pretrain hold; the commands' `run()` functions take them beside the flags.

    GivenModels(policy=module, tokenizer=tok, ref=None)
      policy     the model the run trains: the backend wraps this very module (dtypes, device and LoRA as
                 for a loaded one: rlhfkit.models.loader.adopt_causal_lm), no copy of it is made; the
                 run's rollout engine serves (or copies) its weights
      tokenizer  the run's tokenizer: a copy prepared as a loaded one (pad token, padding side, chat
                 template); without it the tokenizer is loaded from --pretrain
      ref        the frozen reference model; without it, where the algorithm needs a reference, a frozen
                 copy of the policy's initial weights (`frozen_copy`), and none under LoRA (the policy
                 with its adapters switched off is the reference)

With `policy` given, --pretrain only names where the model came from (model cards, run_config.json):
nothing is loaded from it but the tokenizer, when none is given.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.models.hf_files import load_tokenizer, prepare_tokenizer


@dataclass(frozen=True)
class GivenModels:
    policy: torch.nn.Module | None = None
    tokenizer: Any = None
    ref: torch.nn.Module | None = None

    def load_tokenizer(self, path: str, chat_template: str | None = None, use_fast: bool = True,
                       padding_side: str = "right") -> Any:
        """The run's tokenizer: a prepared copy of the given one (the caller's object is left as it is),
        else the one of the model directory `path` (`rlhfkit.models.hf_files.load_tokenizer`)."""
        if self.tokenizer is None:
            return load_tokenizer(path, padding_side=padding_side, chat_template=chat_template, use_fast=use_fast)
        return prepare_tokenizer(copy.deepcopy(self.tokenizer), padding_side, chat_template, "the given tokenizer")

    @property
    def empty(self) -> bool:
        """Nothing given: every model and the tokenizer are loaded from the flags' directories."""
        return self.policy is None and self.tokenizer is None and self.ref is None

    def policy_or_path(self, path: str) -> torch.nn.Module | str:
        """What a check reads the policy's config from: the given module, else the directory `path`."""
        return self.policy if self.policy is not None else path


NONE = GivenModels()  # a run from the command line: every model is loaded from its flag's directory


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s current weights that does not train (a reference made from the policy before the
    policy's first step): parameters detached from autograd, eval mode."""
    out = copy.deepcopy(model)
    out.requires_grad_(False)
    return out.eval()
