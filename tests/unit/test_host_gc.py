"""backend/host_gc.py: the collector is off from pause() to the next collect_deferred(), which
collects the young generations once and switches it on; nothing changes when the collector was off already; an RL step
leaves it on, a pause longer than MAX_PAUSE_S ends by itself, and a one-process step collects at its optimizer step (before the host waits)."""

from __future__ import annotations

import gc

from rlhfkit.backend import host_gc


def test_pause_then_collect_once():
    assert gc.isenabled() and not host_gc.paused()
    calls = []
    gc.callbacks.append(lambda phase, info: calls.append((phase, info["generation"])))
    try:
        host_gc.pause()
        assert not gc.isenabled() and host_gc.paused()
        host_gc.pause()  # idempotent
        calls.clear()
        host_gc.collect_deferred()
        assert gc.isenabled() and not host_gc.paused()
        assert calls == [("start", 1), ("stop", 1)]  # one collection of the young generations
        calls.clear()
        host_gc.collect_deferred()  # nothing paused: nothing collected
        assert calls == []
    finally:
        gc.callbacks.pop()
        gc.enable()


def test_a_long_pause_gives_the_collector_back(monkeypatch):
    import time

    monkeypatch.setattr(host_gc, "MAX_PAUSE_S", 0.05)
    try:
        host_gc.pause()
        assert not gc.isenabled()
        deadline = time.monotonic() + 5
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.isenabled() and host_gc.paused()  # on again; the deferred collection still comes
    finally:
        host_gc.collect_deferred()
    assert gc.isenabled() and not host_gc.paused()


def test_a_disabled_collector_stays_the_users_choice():
    gc.disable()
    try:
        host_gc.pause()
        assert not host_gc.paused()
        host_gc.collect_deferred()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_optimizer_step_collects_before_waiting(monkeypatch):
    import torch
    from torch import nn

    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.parallel.dist import DistInfo
    from rlhfkit.config.configs import BackendConfig, OptimConfig

    model = nn.Linear(4, 2)
    b = FSDP2Backend(model, BackendConfig(param_dtype="fp32"), OptimConfig(learning_rate=1e-2), 10,
                     DistInfo(device="cpu"))
    seen = []
    real = host_gc.collect_deferred
    monkeypatch.setattr(host_gc, "collect_deferred", lambda: (seen.append(gc.isenabled()), real()))
    host_gc.pause()
    b.backward(model(torch.ones(3, 4)).pow(2).mean())
    b.optimizer_step()
    assert seen == [False] and gc.isenabled()
