"""Policy, KL and value losses: hand-derived values, IS weights, micro-batch equivalence."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.losses.correction import is_correction_weights
from rlhfkit.losses.kl import kl_loss
from rlhfkit.losses.policy import PolicyLossConfig, policy_loss
from rlhfkit.losses.reduce import sample_sum_over, seq_mean_over, token_sum_over
from rlhfkit.losses.value import value_loss

close = torch.testing.assert_close

# 2 samples x 3 tokens. ratios r = exp(logp - old):
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.1, 0.7, 3.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
OLD = torch.full((2, 3), -2.0)


def _logp() -> torch.Tensor:
    return (OLD + RATIOS.log()).requires_grad_(True)


def test_ppo_clipped_surrogate_by_hand() -> None:
    # eps 0.2. row0 (A = 1): r 1 -> -1 ; r 1.5 -> -min(1.5, 1.2) = -1.2 (clipped) ; r 0.5 -> -min(0.5, 0.8) = -0.5
    # row1 (A = -1): r 1.1 -> -min(-1.1, -1.1) = 1.1 ; r 0.7 -> -min(-0.7, -0.8) = 0.8 (clipped) ;
    #                r 3 -> -min(-3, -1.2) = 3
    # sum = -1 - 1.2 - 0.5 + 1.1 + 0.8 + 3 = 2.2 ; / 6 tokens = 0.366667 ; clip ratio 2/6
    lp = _logp()
    loss, m = policy_loss(lp, OLD, ADV, torch.ones(2, 3), PolicyLossConfig(), num_tokens=6)
    assert math.isclose(loss.item(), 2.2 / 6, rel_tol=1e-6)
    assert math.isclose(m["ppo_clip_ratio"], 2 / 6, rel_tol=1e-6)
    # ppo_kl = mean(old - new) = -mean(log r)
    assert math.isclose(m["ppo_kl"], -RATIOS.log().mean().item(), rel_tol=1e-6)
    loss.backward()
    # d/dlogp of -r A / 6 = -r A / 6 on unclipped tokens, 0 where clipped
    exp_grad = -(RATIOS * ADV) / 6
    exp_grad[0, 1] = 0.0
    exp_grad[1, 1] = 0.0
    close(lp.grad, exp_grad)


def test_masked_tokens_and_global_count() -> None:
    # drop row1 token2: sum = -1 - 1.2 - 0.5 + 1.1 + 0.8 = -0.8 ; over a global count of 10 tokens
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _ = policy_loss(_logp(), OLD, ADV, mask, num_tokens=10)
    assert math.isclose(loss.item(), -0.08, rel_tol=1e-6)
    loss, _ = policy_loss(_logp(), OLD, ADV, mask)  # local count: 5
    assert math.isclose(loss.item(), -0.16, rel_tol=1e-6)


def test_reductions_by_hand() -> None:
    # rows: [1, 2, (3)] mask [1, 1, 0] ; [4, 4, 4] mask [0, 0, 1] ; [9, 9, 9] empty
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1], [0, 0, 0]])
    # token: (1 + 2 + 4) / 3 local tokens = 7/3 ; / 7 global tokens = 1
    assert math.isclose(token_sum_over(x, mask).item(), 7 / 3, rel_tol=1e-6)
    assert math.isclose(token_sum_over(x, mask, 7).item(), 1.0, rel_tol=1e-6)
    # sequence: row means 1.5 and 4 ; the empty row is not a sequence -> (1.5 + 4) / 2 = 2.75
    assert math.isclose(seq_mean_over(x, mask).item(), 2.75, rel_tol=1e-6)
    assert math.isclose(seq_mean_over(x, mask, torch.tensor(11.0)).item(), 0.5, rel_tol=1e-6)
    # samples: (1 + 2 + 3) / 3 ; / 4 global samples ; an empty step gives 0, not NaN
    assert math.isclose(sample_sum_over(torch.tensor([1.0, 2.0, 3.0])).item(), 2.0, rel_tol=1e-6)
    assert math.isclose(sample_sum_over(torch.tensor([1.0, 2.0, 3.0]), 4).item(), 1.5, rel_tol=1e-6)
    assert token_sum_over(x, torch.zeros(3, 3), 0).item() == 0.0


def test_dual_clip() -> None:
    # c = 2, for A < 0: max(min(.), 2 * -1 = -2): r 1.1 -> -1.1 ; r 0.7 -> -0.8 ; r 3 -> max(-3, -2) = -2
    # sum = -2.7 + 1.1 + 0.8 + 2 = 1.2 ; / 6 = 0.2 ; dual clip active on 1 of 6 tokens
    loss, m = policy_loss(_logp(), OLD, ADV, torch.ones(2, 3), PolicyLossConfig(dual_clip=2.0))
    assert math.isclose(loss.item(), 0.2, rel_tol=1e-6)
    assert math.isclose(m["dual_clip_ratio"], 1 / 6, rel_tol=1e-6)
    with pytest.raises(ValueError, match="--dual_clip"):
        PolicyLossConfig(dual_clip=1.0)


def test_clip_higher() -> None:
    # eps_low 0.2, eps_high 0.28: only r 1.5 (A > 0) changes: -min(1.5, 1.28) = -1.28
    # sum = 2.2 - 0.08 = 2.12 ; / 6 = 0.353333
    cfg = PolicyLossConfig.from_flags(eps_clip=0.2, eps_clip_low_high=(0.2, 0.28))
    loss, _ = policy_loss(_logp(), OLD, ADV, torch.ones(2, 3), cfg)
    assert math.isclose(loss.item(), 2.12 / 6, rel_tol=1e-6)
    # eps_low 0.4: r 0.7 (A < 0) no longer clipped: 0.7 instead of 0.8 -> 2.2 - 0.1 = 2.1
    loss, _ = policy_loss(_logp(), OLD, ADV, torch.ones(2, 3), PolicyLossConfig(eps_clip_low=0.4))
    assert math.isclose(loss.item(), 2.1 / 6, rel_tol=1e-6)


def test_gspo_sequence_ratio_and_sequence_mean() -> None:
    # row0 log-ratios [0.2, -0.4] -> mean -0.1 -> s = 0.904837 ; A = 1 -> loss -0.904837
    # row1 log-ratios [0.5, (masked 9)] -> s = exp(0.5) = 1.648721 -> clipped 1.2 ; A = 2 -> -2.4
    # sequence mean: (-0.904837 - 2.4) / 2 = -1.652419
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.2, -0.4], [0.5, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    loss, m = policy_loss(lp, old, adv, mask, PolicyLossConfig("gspo"))
    assert math.isclose(loss.item(), (-math.exp(-0.1) - 2.4) / 2, rel_tol=1e-6)
    assert math.isclose(m["ppo_clip_ratio"], 1 / 3, rel_tol=1e-6)  # row1's one token


def test_is_correction_weights() -> None:
    # w = exp(old - rollout) = [0.3, 1, 2, 6], band [0.5, 5]
    w = torch.tensor([[0.3, 1.0, 2.0, 6.0], [0.1, 0.2, 1.0, 1.0]])
    old = torch.zeros(2, 4)
    rollout = -w.log()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    tis, _ = is_correction_weights(old, rollout, mask, "tis", (0.5, 5.0))
    close(tis, torch.tensor([[0.5, 1.0, 2.0, 5.0], [0.5, 0.5, 0.0, 0.0]]))
    ice, m = is_correction_weights(old, rollout, mask, "icepop", (0.5, 5.0))
    close(ice, torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert math.isclose(m["is_dropped_ratio"], 4 / 6, rel_tol=1e-6)
    # seq-mask-tis: row0 s = (0.3*1*2*6)^(1/4) = 3.6^0.25 = 1.3774 in band -> unclamped w kept
    #               row1 s = (0.1*0.2)^(1/2) = 0.1414 -> row dropped
    seq, _ = is_correction_weights(old, rollout, mask, "seq-mask-tis", (0.5, 5.0))
    close(seq, torch.tensor([[0.3, 1.0, 2.0, 6.0], [0.0, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="--vllm_is_correction_type"):
        is_correction_weights(old, rollout, mask, "bogus")


def test_policy_loss_applies_tis_and_logs_vllm_kl() -> None:
    # ratio 1 everywhere, A = 1 -> token loss -1 ; TIS weights [0.5, 1, 2, 5] -> sum -8.5 ; / 4 = -2.125
    old = torch.zeros(1, 4)
    rollout = -torch.tensor([[0.3, 1.0, 2.0, 6.0]]).log()
    cfg = PolicyLossConfig.from_flags(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 5.0])
    assert cfg.is_correction == "tis"
    loss, m = policy_loss(old.clone(), old, torch.ones(1, 4), torch.ones(1, 4), cfg, rollout_logprobs=rollout)
    assert math.isclose(loss.item(), -2.125, rel_tol=1e-6)
    assert math.isclose(m["vllm_kl"], rollout.mean().item(), rel_tol=1e-6)
    with pytest.raises(ValueError, match="rollout"):
        policy_loss(old.clone(), old, torch.ones(1, 4), torch.ones(1, 4), cfg)


def test_entropy_bonus() -> None:
    # ratio 1, A = 0 -> policy loss 0 ; entropy [1, 3] -> mean 2 ; coef 0.01 -> loss -0.02
    z = torch.zeros(1, 2)
    loss, m = policy_loss(z.clone(), z, z, torch.ones(1, 2), PolicyLossConfig(entropy_coef=0.01),
                          entropy=torch.tensor([[1.0, 3.0]]))
    assert math.isclose(loss.item(), -0.02, rel_tol=1e-6) and m["entropy"] == 2.0


@pytest.mark.parametrize("cfg", [PolicyLossConfig(), PolicyLossConfig(dual_clip=3.0, eps_clip_high=0.28),
                                 PolicyLossConfig("gspo"), PolicyLossConfig(loss_agg="seq")])
def test_micro_batches_sum_to_the_full_batch_loss(cfg: PolicyLossConfig) -> None:
    g = torch.Generator().manual_seed(0)
    b, length = 8, 10
    old = -torch.rand(b, length, generator=g) * 3
    lp = (old + 0.3 * torch.randn(b, length, generator=g)).requires_grad_(True)
    adv = torch.randn(b, length, generator=g)
    mask = (torch.rand(b, length, generator=g) > 0.3).long()
    mask[5] = 0  # an empty row does not count as a sequence
    n_tok, n_seq = mask.sum().item(), (mask.sum(1) > 0).sum().item()
    full, _ = policy_loss(lp, old, adv, mask, cfg, num_tokens=n_tok, num_sequences=n_seq)
    (g_full,) = torch.autograd.grad(full, lp)
    parts = [slice(0, 3), slice(3, 8)]
    total = sum(policy_loss(lp[s], old[s], adv[s], mask[s], cfg, num_tokens=n_tok, num_sequences=n_seq)[0]
                for s in parts)
    (g_parts,) = torch.autograd.grad(total, lp)
    close(total, full)
    close(g_parts, g_full)


def test_kl_loss_k3() -> None:
    # l = [0.5, -1.0] ; k3 = [0.1065307, 0.7182818] ; sum / 4 global tokens = 0.2062031
    loss, m = kl_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2),
                      estimator="k3", num_tokens=4)
    assert math.isclose(loss.item(), (0.1065307 + 0.7182818) / 4, rel_tol=1e-6)
    assert math.isclose(m["kl"], (0.1065307 + 0.7182818) / 2, rel_tol=1e-6)


def test_value_clipping_by_hand() -> None:
    # c = 0.2
    # t0: V 1.0, old 0.5, R 1.2: (V-R)^2 = 0.04 ; Vclip 0.7 -> 0.25 ; max 0.25 -> 0.125
    # t1: V 0.6, old 0.5, R 0.0: 0.36 ; Vclip 0.6 -> 0.36 -> 0.18
    # t2: V -1.0, old 0.0, R -1.0: 0 ; Vclip -0.2 -> 0.64 -> 0.32
    # t3: V 2.0, old 1.0, R 3.0: 1 ; Vclip 1.2 -> 3.24 -> 1.62
    # mean = (0.125 + 0.18 + 0.32 + 1.62) / 4 = 0.56125 ; clipped term larger on t0, t2, t3
    v = torch.tensor([[1.0, 0.6, -1.0, 2.0]])
    old = torch.tensor([[0.5, 0.5, 0.0, 1.0]])
    ret = torch.tensor([[1.2, 0.0, -1.0, 3.0]])
    loss, m = value_loss(v, old, ret, torch.ones(1, 4), value_clip=0.2)
    assert math.isclose(loss.item(), 0.56125, rel_tol=1e-6)
    assert m["value_clip_ratio"] == 0.75
    # unclipped: 0.5 * (0.04 + 0.36 + 0 + 1) / 4 = 0.175
    loss, _ = value_loss(v, old, ret, torch.ones(1, 4), value_clip=None)
    assert math.isclose(loss.item(), 0.175, rel_tol=1e-6)
    # global count 8 halves it
    loss, _ = value_loss(v, old, ret, torch.ones(1, 4), value_clip=0.2, num_tokens=8)
    assert math.isclose(loss.item(), 0.56125 / 2, rel_tol=1e-6)
