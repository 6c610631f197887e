"""Phases under --deepspeed_enable_sleep / --vllm_enable_sleep: states leave the device lazily, so
the weight push right after the policy's training call needs no reload (the call log is checked)."""

from __future__ import annotations

from rlhfkit.distributed.group import Phases


class FakeGroup:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def run_all(self, method, *args) -> list[None]:  # method: a RoleWorker method
        self.log.append(f"{self.name}.{method.__name__}")
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
    metrics = ph.take_metrics()
    assert set(metrics) == {"time/engine_sleep", "time/states_reload", "time/states_offload", "time/engine_wake",
                            "time/rollout_transitions"}
    # both rollouts' waits: the second held the policy's offload and the wake
    assert metrics["time/rollout_transitions"] >= metrics["time/engine_wake"]
    assert ph.take_metrics() == {}


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


def test_rank_measured_moves_take_the_slowest_rank_and_sum_over_groups():
    class Ranks(FakeGroup):
        def __init__(self, name, log, stats):
            super().__init__(name, log)
            self.stats = stats

        def run_all(self, method: str, *args):
            super().run_all(method)
            return self.stats

    gib = 2**30
    log: list[str] = []
    ph = Phases(train_sleep=True)
    a = Ranks("ref", log, [{"seconds": 0.5, "bytes": 2.0 * gib}, {"seconds": 0.25, "bytes": 1.0 * gib}])
    b = Ranks("policy", log, [{"seconds": 1.0, "bytes": 3.0 * gib}, {"seconds": 2.0, "bytes": 3.0 * gib}])
    for g in (a, b):
        ph.before_group(g)
        ph.after_group(g)
    ph.flush()
    m = ph.take_metrics()
    assert m["time/offload"] == 0.5 + 2.0 and m["offload_gb"] == 2.0 + 3.0
    assert m["time/reload"] == 0.5 + 2.0  # the fake ranks report the same stats for both moves
