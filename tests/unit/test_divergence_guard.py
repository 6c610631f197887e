"""Divergence guard (backend/guard.py): weights grown past --max_weight_growth x max(1, their start) and
more than --max_zero_grad_steps exactly-zero gradients in a row under a non-zero loss stop the run, before
the next step changes anything and before any save; what a healthy run does never trips them."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from rlhfkit.backend.guard import DivergenceError, NonFiniteError, StepGuard

from test_nonfinite_guard import Tiny, backend, masked, snapshot, step


def explode(b, factor: float = 1e4):
    """A hook that multiplies b.weight after the next optimizer step (as a learning rate of ~1e4 would)."""
    def hook(opt, args, kwargs):
        with torch.no_grad():
            b.model.b.weight.mul_(factor)
    return b.optimizer.register_step_post_hook(hook)


def zero_grad_step(b, loss: float = 1.0) -> dict[str, float]:
    """A step whose gradient is exactly 0 and whose loss is `loss` (a saturated network's)."""
    x = torch.ones(4, 3)
    b.backward(b.model(x).sum() * 0.0 + loss)
    return b.optimizer_step()


def test_the_limit_is_the_growth_factor_times_the_start_at_least_1():
    b = backend()
    assert b.guard.start_peak is None
    step(b)  # measured before the first step changes anything
    assert b.guard.start_peak == max(float(p.detach().abs().max()) for p in Tiny().parameters())
    assert b.guard.weight_limit == 100 * max(1.0, b.guard.start_peak)
    g = StepGuard(3, max_weight_growth=10)
    g.start_peak = 0.016  # a LoRA adapter's start: B = 0, A below 1 / sqrt(4096)
    assert g.weight_limit == 10
    g.start_peak = 4.0
    assert g.weight_limit == 40


def test_weights_that_explode_stop_at_the_next_step_before_it_changes_anything():
    b = backend(learning_rate=1e-2)
    hook = explode(b)
    step(b)
    hook.remove()
    before = snapshot(b)
    with pytest.raises(DivergenceError, match=r"^weights diverged after optimizer step 1 \(grad norm [0-9.e+-]+, "
                                              r"learning rate 0\.01\): the largest \|weight\| is [0-9.e+]+ "
                                              r"\(b\.weight\), more than --max_weight_growth 100 x 1 \(the largest "
                                              r"at the start of training, at least 1\): stopping without saving") as e:
        step(b)
    assert not isinstance(e.value, NonFiniteError)
    assert all(torch.equal(p, before[n]) for n, p in b.model.named_parameters())


@pytest.mark.parametrize("then", ["save", "export"])
def test_exploded_weights_are_never_saved(tmp_path, then):
    b = backend()
    explode(b)
    step(b)
    with pytest.raises(DivergenceError, match="weights diverged after optimizer step 1"):
        if then == "save":
            b.save_checkpoint(str(tmp_path / "ckpt"), "global_step1", {"step": 1}, max_keep=2)
        else:
            b.save_hf(str(tmp_path / "hf"))
    assert os.listdir(tmp_path) == []


def test_growth_below_the_limit_goes_on_and_0_turns_the_rule_off(tmp_path):
    b = backend()
    explode(b, factor=50)  # 50x the start: within 100x max(1, start)
    step(b)
    step(b)
    off = backend(max_weight_growth=0)
    explode(off)
    step(off)
    step(off)
    off.save_checkpoint(str(tmp_path / "ckpt"), "s", {}, max_keep=1)
    with pytest.raises(ValueError, match=r"--max_weight_growth must be 0 \(off\) or above 1, got 0\.5"):
        backend(max_weight_growth=0.5)


def test_the_masked_one_gpu_step_is_not_applied_after_weights_exploded(monkeypatch):
    b = masked(backend(), monkeypatch)
    hook = explode(b)
    step(b)
    hook.remove()
    before = snapshot(b)
    with pytest.raises(DivergenceError, match="weights diverged after optimizer step 1"):
        step(b)
    assert all(torch.equal(p, before[n]) for n, p in b.model.named_parameters())


def test_a_resumed_run_compares_with_the_start_of_training(tmp_path):
    b = backend()
    step(b)
    start = b.guard.start_peak
    with torch.no_grad():
        b.model.b.weight.mul_(30)  # grown, within the limit
    b.save_checkpoint(str(tmp_path / "ckpt"), "s1", {"step": 1}, max_keep=1)
    resumed = backend()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.guard.start_peak == start  # not the grown weights of the checkpoint
    resumed.guard.load_state_dict({})  # a checkpoint written before the guard recorded it: measured again
    step(resumed)
    assert resumed.guard.start_peak > 10 * start


def test_zero_gradients_under_a_non_zero_loss_warn_then_stop(caplog):
    b = backend(max_zero_grad_steps=2)
    zero_grad_step(b)  # before any non-zero gradient: not counted (nothing has trained yet)
    step(b)
    with caplog.at_level(logging.WARNING, logger="rlhfkit.backend.guard"):
        zero_grad_step(b)
        zero_grad_step(b, loss=0.0)  # a zero loss has nothing to learn: it ends the row
        zero_grad_step(b)
        zero_grad_step(b)
        with pytest.raises(DivergenceError, match=r"^the gradient was exactly 0 while the loss was not in 3 optimizer "
                                                  r"steps in a row, up to step 7 \(more than --max_zero_grad_steps 2; "
                                                  r"learning rate 0\.01\): the model no longer learns \(saturated\); "
                                                  "stopping without saving"):
            zero_grad_step(b)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"optimizer step {s}: the gradient is exactly 0 while the loss is not, {k} in a row "
                     "(--max_zero_grad_steps 2)" for s, k in ((3, 1), (5, 1), (6, 2), (7, 3))], lines


def test_a_non_zero_gradient_ends_the_row_and_minus_1_turns_the_rule_off():
    b = backend(max_zero_grad_steps=1)
    step(b)
    for _ in range(3):
        zero_grad_step(b)
        step(b)
    off = backend(max_zero_grad_steps=-1)
    step(off)
    for _ in range(5):
        zero_grad_step(off)
    with pytest.raises(ValueError, match=r"--max_zero_grad_steps must be >= -1 \(-1: off\), got -2"):
        backend(max_zero_grad_steps=-2)
