"""What the API trainers take besides a config, turned into what the commands' `run()` reads.

    model / ref_model      a local directory (used as it is), or a loaded transformers model (+ its
                           tokenizer), handed to the run as objects (rlhfkit.models.given): the run
                           trains that module itself, nothing is written to disk; the model flag
                           (--pretrain) names where it came from
    datasets               a list of dicts or a `datasets.Dataset` -> `rlhfkit.data.io.RowSource`
                           (in memory, the same row pipeline as files), or a --dataset spec string
    reward_funcs           a callable in TRL's shape `reward(prompts, completions, **columns)` or
                           OpenRLHF's `reward_func(queries, prompts, labels)` (rlhfkit.rewards.shapes;
                           the signature is checked when the trainer is made), a list of them (summed,
                           `reward_weights`), `per_sample(fn)` wrapped callables, a reward_func .py path
                           (`file.py:name` for another function) or http(s) URL (--remote_rm_url), or a
                           reward model directory (--reward_pretrain)

A callable goes through `rlhfkit.rewards.sources.PythonRewardSource`, the class that runs a
reward_func file: the same thread, time limit, return-value checks, batching with one-sample
retries, and --reward_failure (stop / drop) per sample.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Sequence

from rlhfkit.data.io import RowSource
from rlhfkit.rewards.reward_file import is_reward_file, load_reward_func
from rlhfkit.rewards.shapes import SHAPES, RewardSample, SampleRewardFunction, call_args, reward_shape


def model_origin(model: Any) -> str:
    """What a model card calls a loaded model: the directory or hub id it was loaded from (its
    `name_or_path`; after an API trainer's train(), the directory it was saved to), else its class."""
    from rlhfkit.trainers.model_card import is_hub_id

    source = str(getattr(model, "name_or_path", "") or "")
    if source and (os.path.isdir(source) or is_hub_id(source)):
        return source
    return f"a {type(model).__name__} passed to the Python API"


def model_input(model: Any, what: str = "model") -> tuple[str, Any]:
    """(the model flag's value, the module or None) for a model directory (used as it is) or a loaded
    transformers model: the run trains the module itself and the flag names where it came from (see
    rlhfkit.models.given)."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model), None
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise TypeError(f"{what} must be a model directory or a transformers model, got {type(model).__name__}")
    return model_origin(model), model


def tokenizer_input(tokenizer: Any, model: Any, what: str = "model") -> Any:
    """The tokenizer object a run is given (None: the run loads the one of the model's directory).
    A tokenizer directory is loaded here, once."""
    if isinstance(tokenizer, (str, os.PathLike)):
        if not isinstance(model, (str, os.PathLike)) or os.fspath(tokenizer) != os.fspath(model):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        return None
    if tokenizer is None:
        if not isinstance(model, (str, os.PathLike)) and not os.path.isdir(str(getattr(model, "name_or_path", ""))):
            raise ValueError(f"{what} is a loaded model whose tokenizer is unknown: pass processing_class= "
                             "(the tokenizer)")
        return None
    if not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"{what}: processing_class must be a transformers tokenizer, got {type(tokenizer).__name__}")
    return tokenizer


def data_source(data: Any, name: str) -> Any:
    """A --dataset value: a spec string as it is, in-memory rows as a RowSource, None as None."""
    if data is None or isinstance(data, (str, RowSource)):
        return data
    if isinstance(data, os.PathLike):
        return os.fspath(data)
    return RowSource(data, name)


# ----------------------------------------------------------------------------- rewards


class per_sample(SampleRewardFunction):  # noqa: N801 - used as a function: per_sample(fn)
    """Turn `fn(completion, prompt, label) -> float` into a batch reward function, called per sample.

    `completion` is the generated text without special tokens (`decode(ids, skip_special_tokens=True)`:
    no EOS, no chat-template end marker); `keep_special_tokens=True` gives the text after the prompt as
    generated instead (`'551</s>'` rather than `'551'`). `prompt` is the prompt as templated (the text the
    model continued) and `label` the `label_key` column. Called directly with (queries, prompts, labels)
    only, as a reward_func is, `completion` is the query's text after the prompt."""

    def __init__(self, fn: Callable[[str, str, Any], float], keep_special_tokens: bool = False) -> None:
        self.fn, self.keep_special_tokens = fn, keep_special_tokens
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", "per_sample")

    def __call__(self, queries: list[str], prompts: list[str], labels: list[Any],
                 samples: Sequence[RewardSample] | None = None) -> list[float]:
        if samples is not None and not self.keep_special_tokens:
            completions = [s.completion for s in samples]
        else:
            completions = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
        return [float(self.fn(c, p, lab)) for c, p, lab in zip(completions, prompts, labels)]


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class combine_rewards(SampleRewardFunction):  # noqa: N801 - used as a function
    """One reward function summing several (`weights`: one per function, default 1), each in either shape
    of rlhfkit.rewards.shapes (TRL's `reward(prompts, completions, **columns)` or a reward_func).
    Each function's answer is checked as a reward_func's; its rewards are logged as `reward_<name>`."""

    def __init__(self, funcs: Sequence[Callable[..., Any]], weights: Sequence[float] | None = None) -> None:
        self.funcs = list(funcs)
        self.weights = [1.0] * len(self.funcs) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"reward_weights has {len(self.weights)} values for {len(self.funcs)} reward functions")
        self.names = [_name(f) for f in self.funcs]
        self.shapes = [reward_shape(f, f"reward_funcs[{i}] ({n})") for i, (f, n) in enumerate(zip(self.funcs, self.names))]
        self.__name__ = self.__qualname__ = "+".join(self.names)

    async def __call__(self, queries: list[str], prompts: list[str], labels: list[Any],
                       samples: Sequence[RewardSample] | None = None) -> dict[str, Any]:
        from rlhfkit.rewards.returns import parse_reward_return

        n = len(queries)
        rewards, scores, logs = [0.0] * n, [0.0] * n, {}
        for fn, shape, w, name in zip(self.funcs, self.shapes, self.weights, self.names):
            args, kwargs = call_args(fn, shape, queries, prompts, labels, samples, name)
            raw = fn(*args, **kwargs)
            if inspect.isawaitable(raw):
                raw = await raw
            out = parse_reward_return(raw, n, name)
            rewards = [a + w * b for a, b in zip(rewards, out.rewards)]
            scores = [a + w * b for a, b in zip(scores, out.scores)]
            logs[f"reward_{name}"] = list(out.rewards)
            for k, v in out.extra_logs.items():
                logs[k if k not in logs else f"{name}_{k}"] = v
        return {"rewards": rewards, "scores": scores, "extra_logs": logs}


def reward_inputs(reward_funcs: Any, weights: Sequence[float] | None) -> dict[str, Any]:
    """The RL flags `reward_funcs` sets: {"remote_rm_url": ...} or {"reward_pretrain": ...} (or {}).
    A callable's signature (and a reward file's) is checked here, before any model loads."""
    if reward_funcs is None:
        return {}
    if isinstance(reward_funcs, os.PathLike):
        reward_funcs = os.fspath(reward_funcs)
    if isinstance(reward_funcs, str):
        if is_reward_file(reward_funcs):
            load_reward_func(reward_funcs)  # a missing file, function or a signature of neither shape
            return {"remote_rm_url": reward_funcs}
        if reward_funcs.startswith(("http://", "https://")):
            return {"remote_rm_url": reward_funcs}
        return {"reward_pretrain": reward_funcs}  # reward model directories, comma-separated
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    bad = [f for f in funcs if not callable(f)]
    if bad or not funcs:
        raise TypeError(f"reward_funcs must be a callable ({SHAPES}), a list of them, a reward_func .py path, a "
                        f"reward server URL or a reward model directory; got {bad or funcs}")
    if len(funcs) == 1 and weights is None:
        reward_shape(funcs[0], f"reward_funcs ({_name(funcs[0])})")
        return {"remote_rm_url": funcs[0]}
    return {"remote_rm_url": combine_rewards(funcs, weights)}
