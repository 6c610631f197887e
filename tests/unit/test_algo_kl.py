"""KL estimators and controllers: values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algo.kl import AdaptiveKLController, FixedKLController, compute_approx_kl, make_kl_controller

# log pi = [-1.0, -2.0], log pi_ref = [-1.5, -1.0]  ->  l = [0.5, -1.0]
LP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


def test_k1_is_the_log_ratio() -> None:
    torch.testing.assert_close(compute_approx_kl(LP, REF, "k1"), torch.tensor([[0.5, -1.0]]))


def test_k2_is_half_the_squared_log_ratio() -> None:
    # 0.5^2 / 2 = 0.125 ; (-1)^2 / 2 = 0.5
    torch.testing.assert_close(compute_approx_kl(LP, REF, "k2"), torch.tensor([[0.125, 0.5]]))


def test_k3_is_exp_minus_one_plus_l() -> None:
    # exp(-0.5) - 1 + 0.5 = 0.6065307 - 0.5 = 0.1065307 ; exp(1) - 1 - 1 = 0.7182818
    torch.testing.assert_close(compute_approx_kl(LP, REF, "k3"), torch.tensor([[0.1065307, 0.7182818]]))


def test_estimates_are_clamped_and_masked() -> None:
    lp = torch.tensor([[15.0, -15.0, -12.0, 1.0]])
    ref = torch.zeros(1, 4)
    # k1: 15 -> 10, -15 -> -10, -12 -> -10 ; k3 at l=-12: exp(12) - 13 ~ 1.6e5 -> 10
    torch.testing.assert_close(compute_approx_kl(lp, ref, "k1"), torch.tensor([[10.0, -10.0, -10.0, 1.0]]))
    assert compute_approx_kl(lp, ref, "k3")[0, 2].item() == 10.0
    mask = torch.tensor([[1, 0, 1, 0]])
    torch.testing.assert_close(compute_approx_kl(lp, ref, "k1", mask=mask), torch.tensor([[10.0, 0.0, -10.0, 0.0]]))


def test_unknown_estimator_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--kl_estimator"):
        compute_approx_kl(LP, REF, "k4")


def test_fixed_controller_never_moves() -> None:
    c = make_kl_controller(0.05)
    assert isinstance(c, FixedKLController) and not isinstance(c, AdaptiveKLController)
    c.update(100.0, 1000)
    assert c.value == 0.05


def test_adaptive_controller_ziegler_update() -> None:
    c = make_kl_controller(0.1, target=6.0, horizon=10000)
    assert isinstance(c, AdaptiveKLController)
    # KL 9: error = 9/6 - 1 = 0.5 -> clipped 0.2; beta *= 1 + 0.2 * 1000/10000 = 1.02 -> 0.102
    c.update(9.0, 1000)
    assert math.isclose(c.value, 0.102, rel_tol=1e-12)
    # KL 5.4: error = 0.9 - 1 = -0.1 (inside the clip); beta *= 1 - 0.1 * 5000/10000 = 0.95 -> 0.0969
    c.update(5.4, 5000)
    assert math.isclose(c.value, 0.0969, rel_tol=1e-12)
    state = c.state_dict()
    c2 = make_kl_controller(0.1, target=6.0, horizon=10000)
    c2.load_state_dict(state)
    assert c2.value == c.value


def test_controller_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="--kl_target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="--init_kl_coef"):
        FixedKLController(-1.0)
