"""Post-processors for reward-scored samples (batch_inference `--post_processor`).

Input: rows `{"input", "output", "reward"}`, several rows per prompt (the `--best_of_n` samples of
`batch_inference --eval_task generate`, scored by `--eval_task rm`). Samples are grouped by their
exact `input` text; groups keep the order in which their prompt first appears, and ties keep the
earliest sample.

    rs        rejection sampling (RAFT-style best-of-n): per prompt the best-scoring sample,
              -> {"input", "output", "reward"}                               (train_sft data)
    iter_dpo  iterative / online DPO (preference pairs from the current policy's own samples):
              per prompt chosen = argmax reward, rejected = argmin,
              -> {"prompt", "chosen", "chosen_reward", "rejected", "rejected_reward"}
                                                       (train_dpo data, --prompt_key prompt)
              Prompts whose samples all score the same (one sample, or ties) carry no preference
              and are dropped; the count is reported. (OpenRLHF keeps them as chosen == rejected.)
    csft      conditional SFT (reward-conditioned SFT): every sample is kept, its input
              rewritten with `--reward_template` (default "{input} <rm_score>: {reward} ",
              OpenRLHF's), the reward written with two decimals,
              -> {"input", "output", "reward"}
              so the score sits between prompt and response. At generation time
              `--enable_csft` appends " " + `--csft_prompt` + " " to the prompt (csft_prompt_suffix),
              which is exactly what the default template writes for that score.

The OpenRLHF names `rs`, `iter_dpo`, `csft` are the canonical ones; `rejection_sampling`,
`iterative_dpo` and `conditional_sft` are accepted as aliases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlhfkit.data.io import DataError, Row

DEFAULT_REWARD_TEMPLATE = "{input} <rm_score>: {reward} "
DEFAULT_CSFT_PROMPT = "<rm_score>: 5.00"
ALIASES = {"rejection_sampling": "rs", "iterative_dpo": "iter_dpo", "conditional_sft": "csft"}


@dataclass(frozen=True)
class ScoredSample:
    """One generated sample and its reward (`where`: file and row, for messages)."""

    input: str
    output: str
    reward: float
    where: str = ""


def scored_samples(rows: Sequence[Row], input_key: str = "input", output_key: str = "output",
                   reward_key: str = "reward") -> list[ScoredSample]:
    """Validate rows into `ScoredSample`s; a bad row raises a DataError naming file, row and key."""
    out = []
    for row in rows:
        reward = row.get(reward_key, "the score column written by --eval_task rm")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise row.error(f"key {reward_key!r} must be a finite number, got {reward!r}")
        out.append(ScoredSample(row.get_str(input_key, "--input_key"), row.get_str(output_key, "--output_key"),
                                float(reward), row.where))
    return out


def group_by_prompt(samples: Sequence[ScoredSample]) -> dict[str, list[ScoredSample]]:
    """Samples grouped by exact input text, groups in first-appearance order."""
    groups: dict[str, list[ScoredSample]] = {}
    for s in samples:
        groups.setdefault(s.input, []).append(s)
    return groups


def _best(group: Sequence[ScoredSample]) -> ScoredSample:
    return max(group, key=lambda s: s.reward)  # max/min return the first of equal keys


def _worst(group: Sequence[ScoredSample]) -> ScoredSample:
    return min(group, key=lambda s: s.reward)


def rejection_sampling(samples: Sequence[ScoredSample]) -> list[dict[str, Any]]:
    """Per prompt, the sample with the highest reward."""
    out = []
    for prompt, group in group_by_prompt(samples).items():
        best = _best(group)
        out.append({"input": prompt, "output": best.output, "reward": best.reward})
    return out


def iterative_dpo(samples: Sequence[ScoredSample]) -> tuple[list[dict[str, Any]], int]:
    """Per prompt, (highest, lowest) reward sample as (chosen, rejected); returns (rows, dropped ties)."""
    out, dropped = [], 0
    for prompt, group in group_by_prompt(samples).items():
        chosen, rejected = _best(group), _worst(group)
        if not chosen.reward > rejected.reward:
            dropped += 1
            continue
        out.append({"prompt": prompt, "chosen": chosen.output, "chosen_reward": chosen.reward,
                    "rejected": rejected.output, "rejected_reward": rejected.reward})
    return out, dropped


def check_reward_template(template: str | None, flag: str = "--reward_template") -> str:
    """The template (default DEFAULT_REWARD_TEMPLATE); it must hold `{input}` and `{reward}` once each."""
    if template is None:
        return DEFAULT_REWARD_TEMPLATE
    for key in ("{input}", "{reward}"):
        if template.count(key) != 1:
            raise DataError(f"{flag} must contain {key} exactly once, got {template!r}")
    return template


def format_reward_input(template: str, text: str, reward: float) -> str:
    """`template` with `{reward}` -> reward to 2 decimals and `{input}` -> text (no other braces read)."""
    head, _, tail = template.partition("{input}")
    fill = f"{reward:.2f}"
    return head.replace("{reward}", fill) + text + tail.replace("{reward}", fill)


def conditional_sft(samples: Sequence[ScoredSample], reward_template: str | None = None) -> list[dict[str, Any]]:
    """Every sample, its input rewritten with the reward template."""
    template = check_reward_template(reward_template)
    return [{"input": format_reward_input(template, s.input, s.reward), "output": s.output, "reward": s.reward}
            for s in samples]


def csft_prompt_suffix(prompt: str, csft_prompt: str) -> str:
    """The generation prompt under `--enable_csft`: prompt + " " + csft_prompt.strip() + " "."""
    return f"{prompt} {csft_prompt.strip()} "


def resolve_post_processor(name: str | None, flag: str = "--post_processor") -> str | None:
    """Canonical name (rs | iter_dpo | csft) or None for no post-processing (None, '', 'null', 'none')."""
    if name is None or name.strip().lower() in ("", "null", "none"):
        return None
    key = ALIASES.get(name, name)
    if key not in PROCESSORS:
        names = sorted(PROCESSORS) + sorted(ALIASES)
        raise DataError(f"{flag} must be one of {', '.join(names)}, got {name!r}")
    return key


def apply_post_processor(name: str, samples: Sequence[ScoredSample],
                         reward_template: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """Run post-processor `name` (canonical or alias); returns (rows, a one-line summary)."""
    key = resolve_post_processor(name)
    if key is None:
        return [{"input": s.input, "output": s.output, "reward": s.reward} for s in samples], "no post-processor"
    n_prompts = len(group_by_prompt(samples))
    if key == "rs":
        rows = rejection_sampling(samples)
        return rows, f"rs: best of {len(samples)} samples for {n_prompts} prompts -> {len(rows)} rows"
    if key == "iter_dpo":
        rows, dropped = iterative_dpo(samples)
        if not rows:
            raise DataError(f"iter_dpo: none of the {n_prompts} prompts has samples with different rewards; "
                            "generate several samples per prompt (--best_of_n >= 2)")
        return rows, (f"iter_dpo: {len(rows)} chosen/rejected pairs from {n_prompts} prompts "
                      f"({dropped} prompts dropped: their samples all scored the same)")
    rows = conditional_sft(samples, reward_template)
    return rows, f"csft: {len(rows)} rows with the reward in the input"


PROCESSORS: dict[str, Callable[..., Any]] = {"rs": rejection_sampling, "iter_dpo": iterative_dpo,
                                             "csft": conditional_sft}
