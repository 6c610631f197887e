"""The two shapes of a reward function, told apart once (when the trainer is built), and called alike.

    OpenRLHF (a reward_func file):   reward_func(queries, prompts, labels)
        queries: prompt + completion as generated (special tokens such as the EOS kept), prompts: the
        prompts as templated, labels: the --label_key column
    TRL (GRPOTrainer's reward_funcs): reward(prompts, completions, **kwargs)
        prompts: the --input_key column as the dataset has it (text, or a list of messages);
        completions: the generated text without special tokens (for a conversation,
        [{"role": "assistant", "content": text}]); kwargs: `completion_ids` and every other column of
        the row by name, one value per sample (`label=[...]`, `solution=[...]`)

A function whose parameters name `completions` is in TRL's shape; one that takes three positional
arguments is in OpenRLHF's; anything else is refused with one line naming both shapes. A TRL-shaped
function without ``**kwargs`` gets only the keywords it names. Both return the rewards (a list or a
tensor) or OpenRLHF's dict (`rewards`, `scores`, `extra_logs`).

`RewardSample` is what the executors know of one sample beyond the OpenRLHF arguments; every reward
source receives them (`samples=`), and uses them when its function is in TRL's shape.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

OPENRLHF, TRL, SAMPLES = "openrlhf", "trl", "samples"
SHAPES = ("reward_func(queries, prompts, labels) (OpenRLHF's reward_func file) or "
          "reward(prompts, completions, **kwargs) (TRL's reward function)")


@dataclass(frozen=True)
class RewardSample:
    """One sample as a TRL-shaped reward function sees it.

    prompt: the --input_key value of the row (text, or a list of {role, content} messages), untemplated.
    completion: the generated text, special tokens skipped (`tokenizer.decode(ids, skip_special_tokens=True)`).
    completion_ids: the generated token ids. columns: the row's other columns (name -> value).
    """

    prompt: Any
    completion: str
    completion_ids: list[int] = field(default_factory=list)
    columns: Mapping[str, Any] = field(default_factory=dict)


class SampleRewardFunction(ABC):
    """Base of rlhfkit's own reward functions that read the samples too (`per_sample`, `combine_rewards`):
    called as `fn(queries, prompts, labels, samples=...)`."""

    @abstractmethod
    def __call__(self, queries: list[str], prompts: list[str], labels: list[Any],
                 samples: Sequence[RewardSample] | None = None) -> Any: ...


class RewardShapeUnknown(TypeError):
    """A reward function whose signature fits neither shape."""


def reward_shape(fn: Callable[..., Any], name: str) -> str:
    """OPENRLHF or TRL for `fn` (see the module docstring), SAMPLES for a SampleRewardFunction; `name`
    prefixes the error."""
    if isinstance(fn, SampleRewardFunction):
        return SAMPLES
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature (a builtin): called as a reward_func file's
        return OPENRLHF
    params = sig.parameters
    if "completions" in params and params["completions"].kind is not inspect.Parameter.POSITIONAL_ONLY:
        return TRL
    try:
        sig.bind([], [], [])
    except TypeError:
        shown = f"{getattr(fn, '__name__', type(fn).__name__)}{sig}"
        raise RewardShapeUnknown(f"{name}: {shown} is not a reward function's signature; write "
                                 f"{SHAPES}") from None
    return OPENRLHF


def is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) and "role" in m for m in prompt)


def trl_kwargs(fn: Callable[..., Any], samples: Sequence[RewardSample]) -> dict[str, Any]:
    """The keyword arguments of a TRL-shaped call of `fn` over `samples` (only those it names, unless it
    takes **kwargs). A column some rows lack is None there."""
    prompts = [s.prompt for s in samples]
    completions = [[{"role": "assistant", "content": s.completion}] if is_conversation(s.prompt) else s.completion
                   for s in samples]
    kw: dict[str, Any] = {"prompts": prompts, "completions": completions,
                          "completion_ids": [list(s.completion_ids) for s in samples]}
    names = list(dict.fromkeys(k for s in samples for k in s.columns))
    for k in names:
        if k not in kw:
            kw[k] = [s.columns.get(k) for s in samples]
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


def call_args(fn: Callable[..., Any], shape: str, queries: list[str], prompts: list[str], labels: list[Any],
              samples: Sequence[RewardSample] | None, name: str) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) of one call of `fn` in its `shape`."""
    if shape == OPENRLHF:
        return (queries, prompts, labels), {}
    if shape == SAMPLES:
        return (queries, prompts, labels), {"samples": samples}
    if samples is None or len(samples) != len(queries):
        raise ValueError(f"{name}: a reward function in TRL's shape needs the samples' completions "
                         "(this caller gives only queries, prompts and labels)")
    return (), trl_kwargs(fn, samples)
