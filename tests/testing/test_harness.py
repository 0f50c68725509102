"""The MPI test harness itself: failures fail fast with the rank's traceback, hangs are
killed at the timeout and reported, never a hung CI."""

import os
import time

from hpcpar.testing import run_cases, run_module
from hpcpar.testing.mpi import case_id

HERE = os.path.join(os.path.dirname(__file__), "harness_cases")
CASES = os.path.join(HERE, "cases.py")

pytest_plugins = ["pytester"]


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


def test_one_launch_runs_several_modules_each_in_a_fresh_process():
    """A module that changes the environment, working directory, default dtype, generator,
    grad mode and warning filters leaves none of it to the next module of the launch."""
    leaky, fresh = os.path.join(HERE, "leaky.py"), os.path.join(HERE, "fresh.py")
    cases = [(CASES, "case_ok"), (leaky, "case_changes_the_process"),
             (fresh, "case_sees_a_fresh_process")]
    run = run_cases(cases, 2, timeout=90)
    assert {c: r.status for c, r in run.cases.items()} == {
        case_id(*c): "passed" for c in cases}, run.output[-3000:]


def test_a_failure_in_a_shared_launch_leaves_the_others_reporting_for_themselves(pytester):
    """The plugin's session launch: the abort by a failing case does not turn the cases it
    did not reach (here in another module) into failures; they run in a new launch."""
    pytester.makeconftest('pytest_plugins = ["hpcpar.testing.pytest_plugin"]')
    case = ("from hpcpar.testing import mpi_case\n\n"
            "@mpi_case(nprocs=(2,), timeout=60)\n"
            "def test_{name}(comm):\n"
            "    assert comm.rank == 0 or {ok!r}, 'deliberate'\n")
    pytester.makepyfile(test_a=case.format(name="fails", ok=False),
                        test_b=case.format(name="passes", ok=True))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_fails*", "*AssertionError: deliberate*"])
