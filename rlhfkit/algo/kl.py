"""KL estimators (k1, k2, k3) and KL coefficient controllers.

Monte Carlo estimators of KL(pi || pi_ref), on the per-token log-ratio
l_t = log pi(a_t) - log pi_ref(a_t) of tokens sampled from pi:

    k1 = l                      unbiased, high variance, can be negative
    k2 = l^2 / 2                biased, low variance, >= 0
    k3 = exp(-l) - 1 + l        unbiased, low variance, >= 0

Every estimate is clamped to [-10, 10] (as OpenRLHF's `compute_approx_kl`). `KL_ESTIMATORS`
maps `--kl_estimator` names to functions of `l`; add an entry to add an estimator.

Controllers give the coefficient beta used in reward shaping (`--init_kl_coef`):
`FixedKLController` (default) and `AdaptiveKLController` (a proportional controller that steers
the observed KL towards `--kl_target`, when that flag is set):

    beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)
"""

from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor
KL_CLAMP = 10.0


def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = l."""
    return log_ratio


def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = l^2 / 2."""
    return log_ratio.square() / 2


def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(-l) - 1 + l (the 'low-variance KL' of GRPO)."""
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def compute_approx_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1",
                      mask: Tensor | None = None) -> Tensor:
    """Per-token KL estimate `[B, L]` of pi against pi_ref, clamped to [-10, 10], float32.

    Args:
        logprobs: `[B, L]` log pi of the sampled tokens.
        ref_logprobs: `[B, L]` log pi_ref of the same tokens.
        estimator: `k1`, `k2` or `k3` (`--kl_estimator`).
        mask: optional `[B, L]` loss mask; the result is zero off the mask.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"--kl_estimator {estimator!r} is not one of {sorted(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    log_ratio = logprobs.float() - ref_logprobs.float()
    kl = KL_ESTIMATORS[estimator](log_ratio).clamp(-KL_CLAMP, KL_CLAMP)
    if mask is not None:
        kl = kl * mask.to(kl.dtype)
    return kl


class FixedKLController:
    """A constant KL coefficient (the default)."""

    adaptive = False

    def __init__(self, init_coef: float) -> None:
        if init_coef < 0:
            raise ValueError(f"--init_kl_coef must be >= 0, got {init_coef}")
        self.value = float(init_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Proportional controller of beta that steers the observed KL towards `target`.

    After each rollout of `n_steps` samples with observed mean KL `current_kl`:
    beta <- beta * (1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon).
    """

    adaptive = True

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        super().__init__(init_coef)
        if target <= 0:
            raise ValueError(f"--kl_target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"--kl_horizon must be > 0, got {horizon}")
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(init_coef: float, target: float | None = None,
                       horizon: int = 10000) -> FixedKLController:
    """`--init_kl_coef`, `--kl_target`, `--kl_horizon` -> a controller (adaptive iff target set)."""
    if target is None:
        return FixedKLController(init_coef)
    return AdaptiveKLController(init_coef, target, horizon)
