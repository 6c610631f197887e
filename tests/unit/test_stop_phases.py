"""rlhfkit.trainers.stop: what a signal does in each phase of a run (signals sent to this process)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlhfkit.trainers.stop import RunStopped, StepAbandoned, active, current


def test_before_training_a_signal_ends_the_run_at_once():
    with active() as stop, pytest.raises(RunStopped, match="^stopped by SIGTERM before training started: nothing "
                                                            "to save$") as e:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert e.value.exit_code == 143
    assert current() is not stop  # uninstalled


def test_in_a_step_the_first_signal_asks_for_a_stop_the_second_abandons_it():
    with active(grace_s=30) as stop:
        stop.start_training()
        with stop.step():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert stop.requested() and stop.name == "SIGINT"
        with pytest.raises(StepAbandoned), stop.step():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)


def test_a_step_that_changes_the_weights_is_never_abandoned():
    with active(grace_s=0.05) as stop:
        stop.start_training()
        with stop.step():
            stop.commit()
            os.kill(os.getpid(), signal.SIGTERM)  # and the grace time passes
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert stop.requested()
        saved = stop.stop(7, lambda: "ck/global_step7", abandoned=False)
        assert str(saved) == "stopped by SIGTERM after step 7: checkpoint ck/global_step7" and saved.exit_code == 143


def test_the_grace_time_abandons_a_hung_step():
    with active(grace_s=0.2) as stop:
        stop.start_training()
        t0 = time.monotonic()
        with pytest.raises(StepAbandoned), stop.step():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        assert time.monotonic() - t0 < 5
        out = stop.stop(3, lambda: "ck/global_step3", abandoned=True)
        assert str(out).startswith("stopped by SIGTERM during step 4 (abandoned after 0.2 s or a second signal)")


def test_while_saving_and_after_the_loop_signals_wait():
    with active() as stop:
        stop.start_training()
        stop.signum = signal.SIGINT

        def save():
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C during the checkpoint write
            time.sleep(0.05)
            return "ck/x"

        assert stop.stop(2, save, abandoned=False).saved == "ck/x"
        stop.end_training()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # no exception: the run finishes
