"""Phases under --deepspeed_enable_sleep / --vllm_enable_sleep: states leave the device lazily, so
the weight push right after the policy's training call needs no reload (the call log is checked)."""

from __future__ import annotations

from rlhfkit.distributed.group import Phases


class FakeGroup:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def run_all(self, method: str, *args) -> list[None]:
        self.log.append(f"{self.name}.{method}")
        return [None]


class FakeEngine:
    def __init__(self, log: list[str]) -> None:
        self.log, self.asleep = log, False

    def sleep(self) -> None:
        self.log.append("engine.sleep")
        self.asleep = True

    def wake_up(self) -> None:
        self.log.append("engine.wake")
        self.asleep = False


def test_push_after_training_needs_no_reload_and_offload_happens_before_the_rollout():
    log: list[str] = []
    ph = Phases(engine_sleep=True, train_sleep=True)
    ph.engine = FakeEngine(log)
    ref, policy = FakeGroup("ref", log), FakeGroup("policy", log)
    ph.before_rollout()  # nothing pending, engines awake
    ph.before_group(ref)  # experience: ref pass
    ph.after_group(ref)
    ph.before_group(policy)  # policy training
    ph.after_group(policy)
    with ph.states_on_device(policy):  # the weight push
        log.append("push")
    ph.before_rollout()  # next step's generation
    assert log == ["engine.sleep", "ref.reload", "ref.offload", "policy.reload", "push", "policy.offload",
                   "engine.wake"]
    timings = ph.take_timings()
    assert set(timings) == {"engine_sleep", "states_reload", "states_offload", "engine_wake"}


def test_same_group_twice_stays_on_device_and_flush_offloads_once():
    log: list[str] = []
    ph = Phases(train_sleep=True)
    g = FakeGroup("policy", log)
    for _ in range(2):
        ph.before_group(g)
        ph.after_group(g)
    ph.flush()
    ph.flush()
    assert log == ["policy.reload", "policy.offload"]


def test_without_train_sleep_nothing_moves():
    log: list[str] = []
    ph = Phases()
    g = FakeGroup("policy", log)
    ph.before_group(g)
    ph.after_group(g)
    with ph.states_on_device(g):
        pass
    ph.before_rollout()
    assert log == []
