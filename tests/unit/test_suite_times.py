"""bench/suite_times.py reads pytest's summary line from a `make test` log."""

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)
import suite_times  # noqa: E402

sys.path.remove(BENCH)


def test_the_last_summary_line_is_read_in_every_form():
    log = "\n".join([
        "...........  [ 40%]",
        "3 passed in 1.00s",  # an earlier pytest of the same log: the last one counts
        "FAILED tests/unit/test_x.py::test_y - assert 1 == 2",
        "2 failed, 1456 passed, 83 skipped in 383.46s (0:06:23)",
        "rm -rf /dev/shm/rk-abc",
    ])
    assert suite_times.pytest_summary(log) == "2 failed, 1456 passed, 83 skipped"
    assert suite_times.pytest_summary("===== 1458 passed, 83 skipped, 2 warnings in 571.20s =====") == \
        "1458 passed, 83 skipped, 2 warnings"
    assert suite_times.pytest_summary("1 error in 0.5s") == "1 error"
    assert suite_times.pytest_summary("make: *** [Makefile:40: test] Error 2") == ""
