"""Unbiased pass@k estimator, for evaluation with n samples per prompt.

With n samples of which c are correct:

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

(the product form avoids huge binomials); pass@k = 1 when n - c < k. The dataset value is
the mean over prompts.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n is correct."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"number correct must be in [0, n={n}], got {c}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_from_scores(scores: Tensor, n_samples_per_prompt: int, k: int,
                          threshold: float = 1.0) -> float:
    """Mean unbiased pass@k over prompts; a sample is correct when score >= `threshold`.

    Args:
        scores: `[G * n]` per-sample scores, rows of one prompt contiguous (or `[G, n]`).
        n_samples_per_prompt: n.
        k: the k of pass@k (1 <= k <= n).
        threshold: score at or above which a sample counts as correct.
    """
    n = n_samples_per_prompt
    if scores.numel() % n != 0:
        raise ValueError(f"{scores.numel()} scores cannot be split into groups of n={n}")
    correct = (scores.reshape(-1, n) >= threshold).sum(dim=1).tolist()
    if not correct:
        return 0.0
    return sum(pass_at_k(n, int(c), k) for c in correct) / len(correct)
