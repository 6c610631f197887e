"""Python's cyclic garbage collector moved to where the host waits for the GPU.

A rollout makes hundreds of thousands of Python objects (token lists, log-probs, trajectories), so
the collector runs during it, several times, and every pass stops the host: the rollout engine's
loop, which the GPU waits on between decode chunks (bench/rl_step.py reports the collections' time
per step as gc_s_each).

    pause()             the RL loop, before its rollout: the collector is switched off
    collect_deferred()  the backend, just before it blocks on the GPU in an optimizer step (the
                        training's kernels are queued, the host would only wait): one collection
                        of the young generations (what the rollout made; a full one would walk
                        every long-lived object each step: 0.05 s in a bench process holding two
                        trainers), then the collector is on again, its thresholds as before. The
                        RL loop also calls it at the end of a step (a Ray driver has no optimizer
                        step of its own).

No-op when nothing is paused, or when the collector was off already (the user's choice stands).
A pause lasts at most `MAX_PAUSE_S`: a long agentic rollout whose environments make reference cycles
gets its collector back then (the collection at the optimizer step still happens).
"""

from __future__ import annotations

import gc
import threading

MAX_PAUSE_S = 30.0
_paused = False
_timer: threading.Timer | None = None


def pause() -> None:
    global _paused, _timer
    if not _paused and gc.isenabled():
        gc.disable()
        _paused = True
        _timer = threading.Timer(MAX_PAUSE_S, gc.enable)
        _timer.daemon = True
        _timer.start()


def collect_deferred() -> None:
    global _paused, _timer
    if _paused:
        _paused = False
        if _timer is not None:
            _timer.cancel()
            _timer = None
        gc.collect(1)
        gc.enable()


def paused() -> bool:
    return _paused
