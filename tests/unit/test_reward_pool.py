"""`--reward_workers`: a reward_func file run in worker processes, the default (rlhfkit/rewards/process_pool.py).

* the answers equal the in-thread source's for the same file and batch;
* calls run in separate processes, several at once (two concurrent calls see two worker pids);
* an exception fails that call only (EpisodeError naming the file), the worker goes on;
* a call past --reward_timeout and a worker that dies fail that call; the worker is replaced and
  the next call is answered;
* what the user's code prints does not break the answers (it has a pipe of its own);
* a file that does not import stops at construction, named; the flag's wiring: processes unless
  --reward_workers 0 (threads, with a note saying once what a time limit cannot do there);
* issue 42.5: a reward_func stuck in one C call that holds the GIL (a regular expression that backtracks):
  in a thread the time limit cannot even fire until the call lets go, and the call runs to its end; in a
  worker process the call fails at the limit and the process is killed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import textwrap
import time

import pytest

from rlhfkit.rewards.sources import PythonRewardSource, make_reward_source
from rlhfkit.rewards.process_pool import ProcessRewardSource, default_workers, reward_source_with_workers
from rlhfkit.usercode.run import EpisodeError

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
                                           ("slow", "reward_func did not return within 2 s (--reward_timeout); "
                                                    "its worker process was killed")])
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


def test_the_flag_picks_worker_processes_for_a_file_unless_zero(reward_file, caplog, monkeypatch):
    from rlhfkit.config import notes

    monkeypatch.setattr(notes, "_NOTED", set())  # notes print once per process: another test may have printed them
    caplog.set_level(logging.INFO)  # the notes are log records (printed once a CLI has set up logging)
    pool = reward_source_with_workers(reward_file, 5.0, workers=3)
    assert isinstance(pool, ProcessRewardSource) and pool.workers == 3 and pool.timeout_s == 5.0
    assert reward_source_with_workers(reward_file, 5.0, workers=3) is pool  # one pool per file and settings
    pool.close()
    default = reward_source_with_workers(reward_file, 5.0)  # --reward_workers unset: processes
    assert isinstance(default, ProcessRewardSource) and default.workers == default_workers() >= 1
    default.close()
    assert "runs in threads" not in caplog.text
    assert isinstance(reward_source_with_workers(reward_file, 5.0, workers=0), PythonRewardSource)
    assert "(--reward_workers 0) runs in threads of the trainer: --reward_timeout fails a call that does not " \
           "return, but cannot stop it" in caplog.text
    assert isinstance(make_reward_source(reward_file, 5.0), PythonRewardSource)
    assert isinstance(reward_source_with_workers(lambda q, p, lab: [0.0] * len(q), 5.0, workers=2),
                      PythonRewardSource)
    assert "--reward_workers has no effect" in caplog.text
    assert "a reward function given as a Python callable runs in threads" in caplog.text
    with pytest.raises(ValueError, match="--reward_workers"):
        reward_source_with_workers(reward_file, 5.0, workers=-1)


# ----------------------------------------------------------------------------- a call that holds the GIL

STUCK = textwrap.dedent('''
    import os, re

    def reward_func(queries, prompts, labels):
        with open({log!r}, "a") as f:
            f.write(f"start {{os.getpid()}}\\n")
        if labels[0] == "stuck":  # backtracks for longer than anyone waits, inside one C call holding the GIL
            re.match(r"(a+)+$", "a" * {n} + "b")
            with open({log!r}, "a") as f:
                f.write("returned\\n")
        return [1.0] * len(queries)
''')


def backtracking_length(seconds: float) -> int:
    """A length of "a"s for which `re.match(r"(a+)+$", "a" * n + "b")` takes about `seconds` here (each more
    "a" doubles the time)."""
    n, took = 14, 0.0
    while took < seconds / 4:
        n += 1
        t0 = time.perf_counter()
        re.match(r"(a+)+$", "a" * n + "b")
        took = time.perf_counter() - t0
    return n + 2


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has stopped running
    except FileNotFoundError:
        return True


def test_a_gil_holding_call_is_stopped_by_a_worker_process_not_by_a_thread(tmp_path):
    n = backtracking_length(1.0)  # calibrated on a busy machine it may run faster later: the claim is 4x the limit
    log = tmp_path / "calls.log"
    path = tmp_path / "stuck_reward.py"
    path.write_text(STUCK.format(log=str(log), n=n))
    # in a thread: the time limit of 0.1 s can act only once the C call lets go of the GIL, and the call runs to
    # its end (whether the limit's error or the late answer then wins depends on which the event loop sees first)
    t0 = time.perf_counter()
    try:
        run(PythonRewardSource(str(path), timeout_s=0.1)(["q"], ["p"], ["stuck"]))
    except EpisodeError as e:
        assert "did not return within 0.1 s" in str(e)
    assert time.perf_counter() - t0 > 0.4
    deadline = time.monotonic() + 10
    while "returned" not in log.read_text() and time.monotonic() < deadline:  # abandoned, not stopped
        time.sleep(0.05)
    assert log.read_text().splitlines()[-1] == "returned"
    # in a worker process, a call that would take 2^40 steps: failed at the limit, its process killed
    path.write_text(STUCK.format(log=str(log), n=40))
    log.unlink()
    pool = ProcessRewardSource(str(path), workers=1, timeout_s=1.0)
    try:
        t0 = time.perf_counter()
        with pytest.raises(EpisodeError, match=r"stuck_reward\.py: reward_func did not return within 1 s "
                                               r"\(--reward_timeout\); its worker process was killed"):
            run(pool(["q"], ["p"], ["stuck"]))
        assert time.perf_counter() - t0 < 1.0 + 2.0
        (pid,) = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("start")]
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(pid) and pool.num_restarts == 1
        assert run(pool(["q"], ["p"], ["fine"])).rewards == [1.0]  # a new worker answers the next call
    finally:
        pool.close()


def test_close_pools_stops_every_worker_of_a_finished_run(reward_file):
    import asyncio

    from rlhfkit.rewards.process_pool import close_pools

    pool = reward_source_with_workers(reward_file, 5.0, workers=2)
    asyncio.run(pool(["ab"], ["a"], [None]))
    procs = [w.proc for w in pool._live]
    assert procs and all(p.poll() is None for p in procs)
    close_pools()
    for p in procs:
        p.wait(timeout=10)
    assert pool._closed and reward_source_with_workers(reward_file, 5.0, workers=2) is not pool  # a new run: new pool
    close_pools()


def test_a_worker_whose_trainer_is_gone_leaves_without_a_traceback(tmp_path):
    """A worker that finishes loading the reward file after the trainer stopped reading (its run ended) exits
    quietly: nothing on the terminal the trainer shares, for a file that loads and for one that fails to."""
    import subprocess
    import sys

    from rlhfkit.rewards.process_pool import WORKER

    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    bad.write_text("raise ImportError('no such verifier')\n")
    for path in (good, bad):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the trainer is gone before the worker's first answer
        proc = subprocess.run([sys.executable, WORKER, str(write_end), str(path)], pass_fds=(write_end,),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        os.close(write_end)
        assert proc.returncode == 1, (path.name, proc.returncode, proc.stderr)
        assert proc.stderr == "", (path.name, proc.stderr)
