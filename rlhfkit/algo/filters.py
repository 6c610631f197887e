"""DAPO dynamic sampling filter: a prompt's group is kept by the mean of its scores.

`--dynamic_filtering` with `--dynamic_filtering_reward_range lo hi` (default 0 1): a prompt's
group of n samples is kept only when the mean of their *scores* lies strictly inside
(lo, hi). With 0/1 scores this drops the all-correct and all-wrong groups, whose
group-baselined advantages are all zero. The caller replaces dropped groups with fresh
prompts; `pass_rate` (kept groups / groups seen) is logged as
`dynamic_filtering_pass_rate` (OpenRLHF logs it in percent).

Means and bounds are compared in float64 (the bounds are Python floats, i.e. float64), in
`group_passes` and `dynamic_filter` alike, so both keep exactly the same groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class FilterResult:
    """kept_groups: `[G']` group indices; kept_rows: `[G' * n]` row indices; pass_rate in [0, 1]."""

    kept_groups: Tensor
    kept_rows: Tensor
    pass_rate: float


def _check_range(reward_range: tuple[float, float]) -> tuple[float, float]:
    lo, hi = float(reward_range[0]), float(reward_range[1])
    if not lo < hi:
        raise ValueError(f"--dynamic_filtering_reward_range needs low < high, got ({lo}, {hi})")
    return lo, hi


def group_passes(scores: Tensor, reward_range: tuple[float, float] = (0.0, 1.0)) -> bool:
    """Whether one group (the `[n]` scores of one prompt) is kept: lo < mean(scores) < hi."""
    lo, hi = _check_range(reward_range)
    mean = float(scores.double().mean())
    return lo < mean < hi


def dynamic_filter(scores: Tensor, n_samples_per_prompt: int,
                   reward_range: tuple[float, float] = (0.0, 1.0)) -> FilterResult:
    """Filter the groups of a batch of scores `[G * n]` (rows of one prompt contiguous)."""
    n = n_samples_per_prompt
    if n <= 1:
        raise ValueError("--dynamic_filtering needs --n_samples_per_prompt > 1")
    if scores.dim() != 1 or scores.numel() % n != 0:
        raise ValueError(f"{scores.numel()} scores cannot be split into groups of --n_samples_per_prompt={n}")
    lo, hi = _check_range(reward_range)
    means = scores.double().view(-1, n).mean(dim=1)
    keep = (means > lo) & (means < hi)
    kept_groups = torch.nonzero(keep).flatten()
    rows = (kept_groups[:, None] * n + torch.arange(n, device=scores.device)).flatten()
    return FilterResult(kept_groups, rows, float(keep.float().mean()))
