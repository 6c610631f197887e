"""EagerFused: compiled where it applies, the function itself elsewhere, and eager for good after a failed
compilation (one warning)."""

from __future__ import annotations

import logging

import torch

from rlhfkit.rollout.builtin.kernels import eager_fused
from rlhfkit.rollout.builtin.kernels.eager_fused import EagerFused


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_cpu_calls_run_the_function_itself(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: (_ for _ in ()).throw(AssertionError("compiled on CPU")))
    f = EagerFused(double)
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0)) and f.compiled is None


def test_compiled_when_wanted_and_eager_for_good_after_a_failure(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_compile(fn, dynamic=None):
        def compiled(*args):
            calls.append(args)
            raise RuntimeError("inductor exploded")
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    f = EagerFused(double, wants=lambda args: True)
    with caplog.at_level(logging.WARNING, logger=eager_fused.__name__):
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))  # the failure falls back to eager
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    assert len(calls) == 1 and "inductor exploded" in f.failed  # no second try
    assert sum("torch.compile of double failed" in r.message for r in caplog.records) == 1


def test_bypass_runs_the_function_itself(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: (lambda *a: torch.zeros(1)))
    on = {"bypass": True}
    f = EagerFused(double, bypass=lambda: on["bypass"], wants=lambda args: True)
    assert torch.equal(f(torch.ones(1)), torch.full((1,), 2.0))
    on["bypass"] = False
    assert torch.equal(f(torch.ones(1)), torch.zeros(1))  # the (fake) compiled function
