"""The MPI test harness itself: failures fail fast with the rank's traceback, hangs are
killed at the timeout and reported, never a hung CI."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hpcpar.testing.mpi import case_id, run_cases, run_module

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


def test_a_skip_on_some_ranks_fails():
    """A case skipped on rank 0 and passed on the others is a failure, not a pass."""
    run = run_module(CASES, 2, ["case_skips_on_rank0", "case_after"], timeout=90)
    bad = run.cases["case_skips_on_rank0"]
    assert bad.status == "failed" and list(bad.ranks) == [0], run.output[-3000:]
    assert "skipped on rank(s) [0] but ran on rank(s) [1]" in bad.message
    assert "deliberate skip on rank 0 only" in bad.message
    assert run.cases["case_after"].status == "passed"


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


def test_the_ranks_import_what_pytest_imports(pytester):
    """pytest's ``pythonpath`` setting reaches the ranks: a case imports a helper from a folder
    that only the setting names (as the suite's cases import ``tests.support``)."""
    pytester.makeconftest('pytest_plugins = ["hpcpar.testing.pytest_plugin"]')
    pytester.makeini("[pytest]\npythonpath = helpers\n")
    (pytester.path / "helpers").mkdir()
    (pytester.path / "helpers" / "shared_helper.py").write_text("ANSWER = 42\n")
    pytester.makepyfile(test_a="from hpcpar.testing import mpi_case\n"
                               "from shared_helper import ANSWER\n\n"
                               "@mpi_case(nprocs=(1,), timeout=60)\n"
                               "def test_helper():\n"
                               "    assert ANSWER == 42\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_a_hung_case_in_a_shared_launch_fails_alone(pytester):
    """The plugin's session launch: a case killed at its own timeout fails; the cases after
    it (here in another module) run in a new launch and pass."""
    pytester.makeconftest('pytest_plugins = ["hpcpar.testing.pytest_plugin"]')
    case = ("import time\nfrom hpcpar.testing import mpi_case\n\n"
            "@mpi_case(nprocs=(2,), timeout={timeout})\n"
            "def test_{name}(comm):\n"
            "    time.sleep({sleep} if comm.rank == 0 else 0)\n"
            "    comm.Barrier()\n")
    pytester.makepyfile(test_a=case.format(name="hangs", timeout=5, sleep=3600),
                        test_b=case.format(name="passes", timeout=60, sleep=0))
    t0 = time.monotonic()
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_hangs*", "*killed at its 5 s timeout*"])
    assert time.monotonic() - t0 < 120


def test_a_hanging_case_is_killed_at_its_own_timeout_not_the_launchs():
    """The launch's budget is every case's timeout summed (minutes in a suite's shared
    launch); a hung case is killed at its own."""
    t0 = time.monotonic()
    run = run_module(CASES, 2, ["case_ok", "case_hangs_on_rank0", "case_after"],
                     timeouts={"case_hangs_on_rank0": 5})
    assert run.timed_out and time.monotonic() - t0 < 60, run.output[-2000:]
    hung = run.cases["case_hangs_on_rank0"]
    assert hung.status == "timeout" and "its 5 s timeout" in hung.message, hung.message
    assert run.cases["case_ok"].status == "passed"
    assert run.cases["case_after"].status == "not-run"


_HARNESS = """
import signal, sys, time
from hpcpar.testing.mpi import run_module
def interrupted(*_):
    raise RuntimeError("interrupted, as pytest-timeout interrupts a test")
signal.signal(signal.SIGUSR1, interrupted)
try:
    run_module(sys.argv[1], 2, ["case_hangs_on_rank0"], timeout=600,
               env={"HARNESS_TEST_MARK": sys.argv[2]})
except RuntimeError:
    time.sleep(120)   # and goes on, as pytest goes on to the next test
"""


def _marked(mark: str) -> list[int]:
    """The processes whose environment holds ``HARNESS_TEST_MARK=mark``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if f"HARNESS_TEST_MARK={mark}".encode() in fh.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGUSR1], ids=["killed", "interrupted"])
def test_a_harness_that_dies_takes_its_ranks_along(how):
    """Killed (SIGTERM), or interrupted by an exception (pytest-timeout's way) and going on,
    the process that launched the ranks leaves none of them behind: the ranks of a hung case
    would spin for ever, taking the cores from every test after it."""
    mark = f"{how.name}-{os.getpid()}-{time.monotonic_ns()}"
    harness = subprocess.Popen([sys.executable, "-c", _HARNESS, CASES, mark])
    try:
        deadline = time.monotonic() + 120
        while len(_marked(mark)) < 3 and time.monotonic() < deadline:   # mpiexec, 2 ranks
            time.sleep(0.5)
        assert len(_marked(mark)) >= 3, "the ranks never started"
        time.sleep(2)    # inside the hanging case
        harness.send_signal(how)
        if how == signal.SIGTERM:
            harness.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _marked(mark), f"left behind: {_marked(mark)}"
    finally:
        harness.kill()
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
