"""Non-finite guard (backend/guard.py): skip, count in a row, stop on a non-finite weight, never save one."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.guard import NonFiniteError
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.trainers.metrics import NullLogger
from rlhfkit.trainers.offline import LoopConfig, train_offline

CPU = DistInfo(device="cpu")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 2, bias=False)
        self.b = nn.Linear(2, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def backend(limit: int = 3, dtype: str = "fp32", **optim) -> FSDP2Backend:
    kw = dict(learning_rate=1e-2, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0,
              max_nonfinite_steps=limit)
    kw.update(optim)
    return FSDP2Backend(Tiny(), BackendConfig(param_dtype=dtype), OptimConfig(**kw), 10, CPU,
                        cpu_low_precision=dtype != "fp32")


def step(b: FSDP2Backend, extra: float = 0.0, scale: float = 1.0) -> dict[str, float]:
    """One optimizer step on a fixed input; `extra` is added to the loss (no gradient),
    `scale` multiplies it (and so the gradients)."""
    x = torch.ones(4, 3)
    loss = b.model(x.to(next(b.model.parameters()).dtype)).float().pow(2).mean() * scale + extra
    b.backward(loss)
    return b.optimizer_step()


def snapshot(b: FSDP2Backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in b.model.named_parameters()}


def test_non_finite_loss_with_finite_gradients_is_skipped():
    b = backend()
    before = snapshot(b)
    stats = step(b, extra=float("inf"))  # the gradients are finite; the loss is not
    assert math.isfinite(stats["grad_norm"])
    assert stats["skipped"] == 1.0 and stats["nonfinite_skipped"] == 1.0
    assert all(torch.equal(p, before[n]) for n, p in b.model.named_parameters())
    assert not b.optimizer.state  # AdamW never ran
    stats = step(b)
    assert stats["nonfinite_skipped"] == 0.0
    assert not torch.equal(b.model.a.weight, before["a.weight"])


def test_more_than_the_limit_in_a_row_stops_and_a_good_step_resets_the_count():
    b = backend(limit=2)
    step(b, extra=float("nan"))
    step(b, extra=float("nan"))
    step(b)  # a finite step: the count starts again
    step(b, extra=float("nan"))
    step(b, extra=float("nan"))
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row \(more than --max_nonfinite_steps 2"):
        step(b, extra=float("nan"))


def test_limit_zero_stops_at_the_first_and_negative_is_refused():
    with pytest.raises(NonFiniteError, match="--max_nonfinite_steps 0"):
        step(backend(limit=0), extra=float("nan"))
    with pytest.raises(ValueError, match="--max_nonfinite_steps must be >= 0"):
        backend(limit=-1)


def test_a_step_that_makes_a_weight_infinite_stops_the_run():
    b = backend(learning_rate=0.5)

    def overflow(opt, args, kwargs):  # as an update beyond the float32 range would
        with torch.no_grad():
            b.model.b.weight[0, 0] = float("inf")

    hook = b.optimizer.register_step_post_hook(overflow)
    step(b)  # the check is read with the next step's decision, without a host sync in this one
    hook.remove()
    before = b.model.a.weight.detach().clone()
    with pytest.raises(NonFiniteError, match=r"non-finite weights \(b\.weight\) after optimizer step 1 .*"
                                             r"learning rate 0\.5"):
        step(b)
    assert torch.equal(b.model.a.weight, before)  # raised before that step changed anything


@pytest.mark.parametrize("then", ["save", "export"])
def test_a_ruined_step_is_caught_before_its_weights_leave(tmp_path, then):
    b = backend(learning_rate=0.5)

    def overflow(opt, args, kwargs):
        with torch.no_grad():
            b.model.b.weight[0, 0] = float("nan")

    b.optimizer.register_step_post_hook(overflow)
    step(b)
    with pytest.raises(NonFiniteError, match=r"non-finite weights \(b\.weight\) after optimizer step 1"):
        if then == "save":
            b.save_checkpoint(str(tmp_path / "ckpt"), "global_step1", {"step": 1}, max_keep=2)
        else:
            list(b.named_full_params())
    assert not os.path.exists(tmp_path / "ckpt")


def test_nothing_is_saved_from_non_finite_weights(tmp_path):
    b = backend()
    step(b)
    with torch.no_grad():
        b.model.b.weight[0, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"\(b\.weight\).*refusing to write"):
        b.save_checkpoint(str(tmp_path / "ckpt"), "global_step1", {"step": 1}, max_keep=2)
    assert not os.path.exists(tmp_path / "ckpt")
    with pytest.raises(NonFiniteError, match="refusing to write"):
        b.save_hf(str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


def test_fp16_overflow_is_the_loss_scale_s_business_until_it_is_at_its_minimum():
    b = backend(limit=1, dtype="fp16")
    assert b.loss_scaler is not None
    b.loss_scaler.scale = 2.0 ** 20
    for _ in range(5):  # finite loss, gradients overflow in fp16: skipped, not counted
        stats = step(b, scale=1e3)
        assert stats["skipped"] == 1.0 and stats["nonfinite_skipped"] == 0.0
    assert b.loss_scaler.scale == 2.0 ** 15
    b.loss_scaler.scale = b.loss_scaler.min_scale
    b.guard.in_a_row = 0
    assert step(b, extra=float("nan"))["nonfinite_skipped"] == 1.0  # a non-finite loss always counts
    with pytest.raises(NonFiniteError):
        step(b, scale=1e9)  # overflow at the minimum scale counts too


class Regression:
    """A toy offline task: items are floats, the loss is (w . 1 - y)^2; a NaN item poisons its batch."""

    TOKEN_ADDITIVE = False

    def collate(self, items):
        return torch.tensor(items, dtype=torch.float32)

    def count(self, batch) -> float:
        return float(batch.numel())

    def loss(self, model, batch, global_count):
        pred = model(torch.ones(batch.numel(), 3)).squeeze(-1)
        loss = (pred - batch).pow(2).sum() / global_count
        return loss, {"loss": float(loss.detach())}

    def eval_metrics(self, model, batches):
        return {}


def test_offline_loop_skips_one_injected_non_finite_step_and_goes_on():
    b = backend()
    items = [0.5] * 15 + [float("nan")]
    cfg = LoopConfig(train_batch_size=2, micro_train_batch_size=1, max_epochs=1, show_progress=False)
    seen: list[tuple[dict, dict]] = []

    def record(state, metrics):
        seen.append((dict(metrics), snapshot(b)))

    state = train_offline(Regression(), b, items, cfg, CPU, NullLogger(), on_step_end=record)
    assert state.step == 8 and len(state.history) == 8
    skipped = [i for i, (m, _) in enumerate(seen) if m["nonfinite_skipped"]]
    assert len(skipped) == 1 and math.isnan(seen[skipped[0]][0]["loss"])
    i = skipped[0]
    if i > 0:  # the skipped step left the weights as they were
        assert all(torch.equal(seen[i][1][n], seen[i - 1][1][n]) for n in seen[i][1])
    assert all(torch.isfinite(p).all() for p in b.model.parameters())
    assert sum(m["skipped"] for m, _ in seen) == 1


def masked(b: FSDP2Backend, monkeypatch) -> FSDP2Backend:
    """`b` with the one-GPU path (backend/optim_step.py): fused AdamW (CPU kernel here), update masked on
    the device by `found_inf` and launched before the host decides."""
    from rlhfkit.backend import optim_step

    monkeypatch.setattr(optim_step, "can_mask_step", lambda opt, norm, ranks, scale: opt is b.optimizer)
    for g in b.optimizer.param_groups:
        g["fused"], g["foreach"] = True, False
    return b


def test_masked_step_equals_the_decided_step(monkeypatch):
    plain, fast = backend(), masked(backend(), monkeypatch)
    for k in range(3):
        m0, m1 = step(plain, scale=1.0 + k), step(fast, scale=1.0 + k)
        assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-6) and m1["skipped"] == 0.0
    for (n, p0), p1 in zip(plain.model.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-7, msg=n)
        # the moments hold the clipped gradients (steps 2 and 3 have norms above --max_norm 1; AdamW's
        # update itself hardly changes with a gradient's scale, its moments do)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fast.optimizer.state[p1][k], plain.optimizer.state[p0][k], rtol=1e-6,
                                       atol=1e-9, msg=f"{n} {k}")
    assert not torch.equal(snapshot(fast)["a.weight"], Tiny().a.weight)  # the steps moved the weights


def test_masked_step_skips_a_non_finite_step_on_the_device(monkeypatch):
    b = masked(backend(), monkeypatch)
    step(b)
    before = snapshot(b)
    state = {k: v.clone() for k, v in b.optimizer.state[b.optimizer.param_groups[0]["params"][0]].items()}
    lr = b.lr
    launched = []
    b.optimizer.register_step_pre_hook(lambda *a: launched.append(1))
    out = step(b, extra=float("nan"))
    assert launched == [1]  # the update was launched (before the decision) ...
    assert out["skipped"] == 1.0 and out["nonfinite_skipped"] == 1.0  # ... and masked
    for n, p in snapshot(b).items():
        assert torch.equal(p, before[n]), n
    after = b.optimizer.state[b.optimizer.param_groups[0]["params"][0]]
    for k, v in state.items():  # moments and step count unchanged: the fused kernel did nothing
        assert torch.equal(after[k], v), k
    assert b.lr == lr
    assert step(b)["skipped"] == 0.0  # and the next finite step goes on
    assert not torch.equal(snapshot(b)["a.weight"], before["a.weight"])


def test_masked_step_stops_on_the_previous_step_s_weights_before_changing_anything(monkeypatch):
    b = masked(backend(learning_rate=0.5), monkeypatch)

    def overflow(opt, args, kwargs):
        with torch.no_grad():
            b.model.b.weight[0, 0] = float("inf")

    hook = b.optimizer.register_step_post_hook(overflow)
    step(b)
    hook.remove()
    before = snapshot(b)
    with pytest.raises(NonFiniteError, match=r"non-finite weights \(b\.weight\) after optimizer step 1"):
        step(b)
    assert torch.equal(snapshot(b)["a.weight"], before["a.weight"])
