"""SFT, DPO/IPO/cDPO, KTO, pairwise RM, PRM and distillation losses: values by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.losses.distill import distill_loss
from rlhfkit.losses.kto import kto_loss, kto_reference_point, mismatched_indices
from rlhfkit.losses.preference import dpo_loss
from rlhfkit.losses.prm import prm_loss
from rlhfkit.losses.reward_model import pairwise_rm_loss
from rlhfkit.losses.sft import sft_loss

T = torch.tensor


def approx(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


def test_sft_token_nll() -> None:
    # masked NLL: 2 + 3 + 0.5 + 4 = 9.5 over 4 tokens = 2.375 ; over a global 10 tokens = 0.95
    lp = T([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.0]])
    mask = T([[0, 1, 1], [1, 1, 0]])
    loss, m = sft_loss(lp, mask)
    assert approx(loss.item(), 2.375)
    loss, m = sft_loss(lp, mask, 10)
    assert approx(loss.item(), 0.95) and m["nll_sum"] == 9.5 and m["num_tokens"] == 4.0
    # two micro-batches with the global count sum to the whole
    a, _ = sft_loss(lp[:1], mask[:1], 4)
    b, _ = sft_loss(lp[1:], mask[1:], 4)
    assert approx((a + b).item(), 2.375)


# beta 0.1 ; row0: z = (-10 + 12) - (-11 + 11) = 2 ; row1: z = (-8 + 7) - (-8 + 8) = -1
PAIRS = dict(chosen_logps=T([-10.0, -8.0]), rejected_logps=T([-12.0, -7.0]),
             ref_chosen_logps=T([-11.0, -8.0]), ref_rejected_logps=T([-11.0, -8.0]))


def test_dpo_sigmoid_loss_and_metrics() -> None:
    # -log sigmoid(0.2) = log(1 + e^-0.2) = 0.598139 ; -log sigmoid(-0.1) = log(1 + e^0.1) = 0.744397
    loss, m = dpo_loss(**PAIRS, beta=0.1)
    assert approx(loss.item(), (0.598139 + 0.744397) / 2)
    # chosen rewards 0.1*(1, 0) ; rejected 0.1*(-1, 1) ; accuracy [T, F] ; margins [0.2, -0.1]
    assert approx(m["chosen_reward"], 0.05) and approx(m["rejected_reward"], 0.0)
    assert m["accuracy"] == 0.5 and approx(m["margin"], 0.05)


def test_cdpo_label_smoothing() -> None:
    # eps 0.1: -(0.9) log sig(bz) - 0.1 log sig(-bz), and -log sig(-x) = -log sig(x) + x:
    # row0 0.598139 + 0.1*0.2 = 0.618139 ; row1 0.744397 + 0.1*(-0.1) = 0.734397
    loss, _ = dpo_loss(**PAIRS, beta=0.1, label_smoothing=0.1)
    assert approx(loss.item(), (0.618139 + 0.734397) / 2)


def test_ipo() -> None:
    # 1/(2 beta) = 5: (2 - 5)^2 = 9 ; (-1 - 5)^2 = 36 ; mean 22.5
    loss, _ = dpo_loss(**PAIRS, beta=0.1, ipo=True)
    assert approx(loss.item(), 22.5)
    with pytest.raises(ValueError, match="--label_smoothing"):
        dpo_loss(**PAIRS, ipo=True, label_smoothing=0.1)


def test_dpo_nll_term_and_global_count() -> None:
    # + 0.2 * (1.5 + 2.5) / 2 = 0.4 ; with 4 global pairs everything halves
    base = (0.598139 + 0.744397) / 2
    loss, m = dpo_loss(**PAIRS, beta=0.1, chosen_nll=T([1.5, 2.5]), nll_loss_coef=0.2)
    assert approx(loss.item(), base + 0.4) and approx(m["nll_loss"], 2.0)
    loss, _ = dpo_loss(**PAIRS, beta=0.1, chosen_nll=T([1.5, 2.5]), nll_loss_coef=0.2, num_samples=4)
    assert approx(loss.item(), (base + 0.4) / 2)


def test_kto_by_hand() -> None:
    # beta 0.1, z = 0.5 ; h = [2 (good), -1 (bad), 0 (good)] ; w_d 1, w_u 2
    # good: 1 - sig(0.1*(2 - 0.5)) = 1 - sig(0.15) = 0.462570 ; 1 - sig(0.1*(0 - 0.5)) = 1 - sig(-0.05) = 0.512497
    # bad:  2 * (1 - sig(0.1*(0.5 + 1))) = 2 * 0.462570
    # mean over 3: (0.462570 + 0.512497 + 0.925140) / 3 = 0.633402
    logps = T([-3.0, -6.0, -4.0], requires_grad=True)
    ref = T([-5.0, -5.0, -4.0])
    good = T([True, False, True])
    loss, m = kto_loss(logps, ref, good, beta=0.1, undesirable_weight=2.0, kl_reference=0.5)
    assert approx(loss.item(), 0.633402)
    assert approx(m["chosen_reward"], 0.1) and approx(m["rejected_reward"], -0.1) and m["kl"] == 0.5


def test_kto_reference_point_from_mismatched_pairs() -> None:
    # diffs [0.5, 1.0] -> mean 0.75 ; negative mean is clamped to 0 ; no gradient flows into z
    kl_lp = T([-5.0, -6.0], requires_grad=True)
    z = kto_reference_point(kl_lp, T([-5.5, -7.0]))
    assert z.item() == 0.75 and not z.requires_grad
    assert kto_reference_point(T([-9.0]), T([-5.0])).item() == 0.0
    assert mismatched_indices(3).tolist() == [2, 0, 1]
    loss, m = kto_loss(T([-3.0]), T([-5.0]), T([True]), beta=0.1, kl_logps=kl_lp, ref_kl_logps=T([-5.5, -7.0]))
    assert m["kl"] == 0.75  # 1 - sig(0.1*(2 - 0.75)) = 1 - sig(0.125) = 0.468791
    assert approx(loss.item(), 0.468791)


def test_pairwise_rm_losses() -> None:
    rc, rr = T([2.0, 0.5]), T([1.0, 1.5])
    # -log sig(1) = 0.313262 ; -log sig(-1) = 1.313262 -> mean 0.813262
    loss, m = pairwise_rm_loss(rc, rr)
    assert approx(loss.item(), 0.813262) and m["accuracy"] == 0.5
    # margin [0.5, 0]: -log sig(0.5) = 0.474077 -> (0.474077 + 1.313262) / 2 = 0.893669
    loss, _ = pairwise_rm_loss(rc, rr, margin=T([0.5, 0.0]))
    assert approx(loss.item(), 0.893669)
    # LogExp: log(1 + exp(r_r - r_c)) equals the sigmoid loss without margin
    loss, _ = pairwise_rm_loss(rc, rr, loss_type="logexp", num_samples=4)
    assert approx(loss.item(), 0.813262 / 2)


def _prm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    # vocab 5, placeholder id 2, reward tokens "+" = 3, "-" = 4 ; placeholders at positions 1 and 3
    ids = T([[1, 2, 1, 2]])
    logits = torch.zeros(1, 4, 5)
    logits[0, 1, 3], logits[0, 1, 4] = 2.0, 0.0
    logits[0, 3, 3], logits[0, 3, 4] = 1.0, 1.0
    logits[0, :, 0] = 50.0  # other vocabulary entries must not matter
    return ids, logits


def test_prm_hard_labels() -> None:
    ids, logits = _prm_batch()
    labels = T([[-100, 3, -100, 4]])
    # pos1: CE([2, 0], class 0) = log(1 + e^-2) = 0.126928 ; pos3: CE([1, 1], class 1) = log 2 = 0.693147
    loss, m = prm_loss(logits, ids, labels, placeholder_token_id=2, reward_token_ids=[3, 4])
    assert approx(loss.item(), (0.126928 + 0.693147) / 2)
    assert m["prm_accuracy"] == 0.5  # pos3 is a tie -> argmax class 0 != 1
    with pytest.raises(ValueError, match="--reward_tokens"):
        prm_loss(logits, ids, T([[-100, 3, -100, 1]]), placeholder_token_id=2, reward_token_ids=[3, 4])


def test_prm_soft_labels() -> None:
    ids, logits = _prm_batch()
    labels = T([[0.0, 0.8, 0.0, 0.3]])
    # pos1: log p = [-0.126928, -2.126928] -> 0.8*0.126928 + 0.2*2.126928 = 0.526928 ; pos3: log 2
    loss, _ = prm_loss(logits, ids, labels, placeholder_token_id=2, reward_token_ids=[3, 4])
    assert approx(loss.item(), (0.526928 + 0.693147) / 2)


def test_distillation_forward_kl_plus_nll() -> None:
    # teacher p = [0.5, 0.25, 0.25], student q = [0.25, 0.5, 0.25], label 1
    # KL(p||q) = 0.5 ln 2 + 0.25 ln 0.5 = 0.25 ln 2 = 0.173287 ; NLL = -ln 0.5 = 0.693147
    # 0.6 * 0.693147 + 0.4 * 0.173287 = 0.485203 ; the second token is off the mask
    teacher = torch.log(T([[[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]]))  # log 0 = -inf must not give NaN
    student = torch.log(T([[[0.25, 0.5, 0.25], [0.2, 0.3, 0.5]]]))
    loss, m = distill_loss(student, teacher, T([[1, -100]]), T([[1, 0]]), kd_coef=0.4)
    assert approx(loss.item(), 0.485203)
    assert approx(m["kd_loss"], 0.173287)
    # the masked-out second token: teacher one-hot on v0, KL = ln(1/0.2) finite
    assert not torch.isnan(loss)
