"""Helpers of the online RL loop (rl.py) that read a step's results: the experience metrics reduced over
the data-parallel ranks, why a step has nothing to train on, and the groups that kept all their samples."""

from __future__ import annotations

import itertools

import torch

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.trainers.rl_config import RLLoopConfig
from rlhfkit.types import Trajectory


EXPERIENCE_KEYS = ("reward", "group_reward_std", "return", "advantage", "kl")
ROW_WEIGHTED = ("reward", "group_reward_std")  # per-row means; the others are per action token


def global_experience_metrics(local: dict[str, float], batch, dist: DistInfo) -> dict[str, float]:
    """Rank-local means of `finish_experience` -> means over the whole global batch.

    Rows (reward, group_reward_std) or action tokens (return, advantage, kl) weight each rank's
    mean, so the result equals the one-process value and every rank gets the same `kl` (the
    adaptive KL controller must move identically on all ranks). The reduced keys are a fixed
    list, so a rank lacking one (e.g. group_reward_std after a drop) still joins the collective."""
    rows, tokens = float(batch.batch_size), float(batch.loss_mask.sum())
    w = [(rows if k in ROW_WEIGHTED else tokens) if k in local else 0.0 for k in EXPERIENCE_KEYS]
    vals = [local.get(k, 0.0) * wk for k, wk in zip(EXPERIENCE_KEYS, w)]
    tot = dist.all_reduce_dp(torch.tensor(vals + w, dtype=torch.float64)).tolist()
    n = len(EXPERIENCE_KEYS)
    out = {k: v for k, v in local.items() if k not in EXPERIENCE_KEYS}
    out.update({k: tot[i] / max(tot[n + i], 1e-12) for i, k in enumerate(EXPERIENCE_KEYS) if tot[n + i] > 0})
    return out


def skip_cause(m: dict[str, float], cfg: RLLoopConfig, empty_ranks: int, world_size: int) -> str:
    """Why a step has no trajectory to train on, from its (global) rollout metrics."""
    parts = []
    dropped, incomplete = int(m.get("dropped_samples", 0)), int(m.get("incomplete_group_samples", 0))
    if dropped:
        parts.append(f"{dropped} samples failed in {cfg.failure_source} and were dropped (--reward_failure drop; "
                     f"the warnings above name the error)")
    if incomplete:
        parts.append(f"{incomplete} more were left out with their incomplete groups")
    if cfg.dynamic_filtering:
        lo, hi = cfg.dynamic_filtering_reward_range
        rate, rounds = m.get("dynamic_filtering_pass_rate", 0.0), int(m.get("filter_rounds", 0))
        why = (f"--max_filter_rounds {cfg.max_filter_rounds}" if rounds >= cfg.max_filter_rounds
               else "every prompt was drawn once in this step")
        parts.append(f"dynamic filtering kept no group in {rounds} rounds ({why}; groups with a mean score "
                     f"inside --dynamic_filtering_reward_range {lo:g} {hi:g}: {rate:.0%})")
    cause = "; ".join(parts) or "the rollout produced no trajectory"
    if empty_ranks < world_size:
        cause += f" (on {empty_ranks} of {world_size} ranks)"
    return cause


def complete_groups(trajs: list[Trajectory], n: int) -> list[list[Trajectory]]:
    """Trajectories grouped by prompt, keeping only groups that still hold all n samples."""
    groups = [list(g) for _, g in itertools.groupby(trajs, key=lambda t: t.group_index)]
    return [g for g in groups if len(g) == n]
