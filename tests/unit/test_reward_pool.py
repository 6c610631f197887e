"""`--reward_workers N`: a reward_func file run in worker processes (rlhfkit/agents/reward_pool.py).

* the answers equal the in-thread source's for the same file and batch;
* calls run in separate processes, several at once (two concurrent calls see two worker pids);
* an exception fails that call only (EpisodeError naming the file), the worker goes on;
* a call past --reward_timeout and a worker that dies fail that call; the worker is replaced and
  the next call is answered;
* what the user's code prints does not break the answers (it goes to stderr);
* a file that does not import stops at construction, named; the flag's wiring in make_reward_source.
"""

from __future__ import annotations

import asyncio
import logging
import os
import textwrap

import pytest

from rlhfkit.agents.reward_func import PythonRewardSource, make_reward_source
from rlhfkit.agents.reward_pool import ProcessRewardSource, reward_source_with_workers
from rlhfkit.agents.user_code import EpisodeError

SRC = textwrap.dedent('''
    import os, sys, time

    def reward_func(queries, prompts, labels):
        print("user print on stdout")
        if labels and labels[0] == "raise":
            raise ValueError("bad sample")
        if labels and labels[0] == "exit":
            os._exit(3)
        if labels and labels[0] == "slow":
            time.sleep(30)
        if labels and labels[0] == "pid":
            time.sleep(0.5)
            return {"rewards": [float(os.getpid())] * len(queries)}
        r = [sum(c.isdigit() for c in q) / max(len(q), 1) for q in queries]
        return {"rewards": r, "scores": [x * 2 for x in r], "extra_logs": {"n": [len(q) for q in queries]}}
''')


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(SRC)
    return str(path)


def run(coro):
    return asyncio.run(coro)


def test_answers_equal_the_thread_source(reward_file):
    pool = ProcessRewardSource(reward_file, workers=2, timeout_s=20)
    try:
        q = ["a1b22", "no digits", "7"]
        got = run(pool(q, ["p"] * 3, [None] * 3))
        ref = run(PythonRewardSource(reward_file)(q, ["p"] * 3, [None] * 3))
        assert got.to_dict() == ref.to_dict()
        assert got.rewards == pytest.approx([3 / 5, 0.0, 1.0])
    finally:
        pool.close()


def test_concurrent_calls_run_in_separate_processes(reward_file):
    pool = ProcessRewardSource(reward_file, workers=2, timeout_s=20)

    async def both():
        return await asyncio.gather(pool(["x"], ["p"], ["pid"]), pool(["y"], ["p"], ["pid"]))

    try:
        a, b = run(both())
        pids = {a.rewards[0], b.rewards[0]}
        assert len(pids) == 2 and float(os.getpid()) not in pids
    finally:
        pool.close()


@pytest.mark.parametrize("label,message", [("raise", "reward_func raised ValueError: bad sample"),
                                           ("exit", "the reward worker process died (exit code 3)"),
                                           ("slow", "took more than --reward_timeout 2 s")])
def test_a_failing_call_fails_alone_and_the_pool_goes_on(reward_file, label, message):
    pool = ProcessRewardSource(reward_file, workers=1, timeout_s=2)
    try:
        with pytest.raises(EpisodeError) as e:
            run(pool(["x"], ["p"], [label]))
        assert message in str(e.value) and reward_file in str(e.value)
        assert run(pool(["12"], ["p"], [None])).rewards == [1.0]
        assert pool.num_restarts == (0 if label == "raise" else 1)
    finally:
        pool.close()


def test_a_broken_file_stops_at_construction(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_here\n")
    with pytest.raises(ImportError, match="bad.py"):
        ProcessRewardSource(str(bad), workers=2)


def test_the_flag_picks_worker_processes_for_a_file_only(reward_file, caplog):
    caplog.set_level(logging.INFO)  # the note is a log record (printed once a CLI has set up logging)
    pool = reward_source_with_workers(reward_file, 5.0, workers=3)
    assert isinstance(pool, ProcessRewardSource) and pool.workers == 3 and pool.timeout_s == 5.0
    pool.close()
    assert isinstance(reward_source_with_workers(reward_file, 5.0), PythonRewardSource)
    assert isinstance(make_reward_source(reward_file, 5.0), PythonRewardSource)
    assert isinstance(reward_source_with_workers(lambda q, p, lab: [0.0] * len(q), 5.0, workers=2),
                      PythonRewardSource)
    assert "--reward_workers has no effect" in caplog.text
    with pytest.raises(ValueError, match="--reward_workers"):
        reward_source_with_workers(reward_file, 5.0, workers=-1)
