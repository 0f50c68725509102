"""The MPI test harness itself: failures fail fast with the rank's traceback, hangs are
killed at the timeout and reported, never a hung CI."""

import os
import time

from hpcpar.testing import run_module

CASES = os.path.join(os.path.dirname(__file__), "harness_cases", "cases.py")


def test_failing_rank_fails_fast_with_traceback():
    t0 = time.monotonic()
    run = run_module(CASES, 3, ["case_ok", "case_fails_on_last_rank", "case_after"],
                     timeout=90)
    assert not run.timed_out and time.monotonic() - t0 < 60
    assert run.cases["case_ok"].status == "passed"
    bad = run.cases["case_fails_on_last_rank"]
    assert bad.status == "failed" and list(bad.ranks) == [2]
    assert "deliberate failure on the last rank" in bad.ranks[2]
    assert "ValueError" in bad.ranks[2] and "rank 2" in bad.ranks[2]
    assert run.cases["case_after"].status == "not-run"


def test_hanging_case_is_killed_at_timeout():
    t0 = time.monotonic()
    run = run_module(CASES, 2, ["case_ok", "case_hangs_on_rank0"], timeout=15)
    assert run.timed_out
    assert time.monotonic() - t0 < 40
    hung = run.cases["case_hangs_on_rank0"]
    assert hung.status == "timeout"
    assert "rank(s) [0, 1] still inside" in hung.message or "[0]" in hung.message
