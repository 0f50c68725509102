"""Launching MPI test cases under ``mpiexec`` and collecting per-rank results.

One ``mpiexec -n N`` runs many cases in order, of one module (:func:`run_module`) or of several
(:func:`run_cases`: the pytest plugin's one launch per rank count for the session), as a new Python
process that imports torch costs seconds on small machines. A case that raises on any rank writes
its traceback and aborts the whole job at once (``MPI.Abort``), so a failure never becomes a
deadlock; a case that hangs is killed at its own timeout (counted from when every rank has entered
it), and the report says which ranks were still inside which case. The launch dies with the process
that started it (killed, or interrupted by an exception such as pytest-timeout's): no ranks are left
spinning behind it."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field

from hpcpar.launch.mpiexec import find_mpiexec, rank_env

__all__ = ["mpi_case", "CaseResult", "ModuleRun", "startup_allowance", "run_module", "run_cases",
           "case_id"]

DEFAULT_TIMEOUT = 120.0
_POLL = 0.5           # seconds between looks at the ranks' progress files
_PR_SET_PDEATHSIG = 1


def mpi_case(nprocs: int | Sequence[int] = (1, 2, 4),
             timeout: float = DEFAULT_TIMEOUT) -> Callable[[Callable], Callable]:
    """Mark a test function to run on every rank under ``mpiexec -n N`` for each N in ``nprocs``
    (``HPCPAR_TEST_MAX_NP`` skips larger ones).

    The function takes no arguments, or one named ``comm`` (``MPI.COMM_WORLD``). Assertions inside
    run on every rank; any rank failing fails the case. All cases of one module and rank count share
    one launch. After ``timeout`` seconds the case is killed and reported with the ranks still in
    it.

    Example:
        ```python
        @mpi_case(nprocs=(1, 2, 4), timeout=60)
        def test_allreduce(comm):
            ...   # runs on every rank
        ```"""
    if isinstance(nprocs, int):
        nprocs = (nprocs,)

    def deco(fn):
        fn._hpcpar_mpi = {"nprocs": tuple(nprocs), "timeout": float(timeout)}
        return fn

    return deco


@dataclass
class CaseResult:
    """The outcome of one case at one rank count; ``ranks`` maps a rank to its traceback or message,
    ``duration`` is in seconds."""

    name: str
    status: str  # passed | failed | skipped | timeout | not-run
    message: str = ""
    ranks: dict = field(default_factory=dict)  # rank -> traceback / message
    duration: float = 0.0


@dataclass
class ModuleRun:
    """One ``mpiexec`` launch of test cases: ``path`` is "" for a launch of several modules;
    ``cases`` maps the case name (:func:`run_module`) or :func:`case_id` (:func:`run_cases`) to its
    ``CaseResult``; ``returncode`` is None if ``mpiexec`` never ended; ``elapsed`` is in seconds."""

    path: str
    nprocs: int
    cases: dict  # name -> CaseResult
    returncode: int | None
    output: str
    timed_out: bool
    elapsed: float


def startup_allowance(nprocs: int) -> float:
    """``20 + 4 * nprocs``: seconds to allow for launching N Python+torch processes on a small
    machine."""
    return 20.0 + 4.0 * nprocs


def case_id(path: str, name: str) -> str:
    """The name of a case in a launch of several modules: ``/abs/path.py::name``."""
    return f"{os.path.abspath(path)}::{name}"


def run_module(path: str, nprocs: int, cases: list[str], timeouts: dict | None = None,
               timeout: float | None = None, env: dict | None = None) -> ModuleRun:
    """Run some cases (function names, in order) of a test module on ``nprocs`` ranks in one
    ``mpiexec`` launch; results by case name. ``timeouts``: case name -> seconds
    (``DEFAULT_TIMEOUT`` otherwise); ``timeout`` for the whole launch defaults to the start-up
    allowance plus every case's; ``env`` adds variables for the ranks."""
    timeouts = timeouts or {}
    run = run_cases([(path, c) for c in cases], nprocs,
                    {case_id(path, c): t for c, t in timeouts.items()}, timeout, env)
    run.cases = {c: dataclasses.replace(run.cases[case_id(path, c)], name=c) for c in cases}
    run.path = path
    return run


def run_cases(cases: list[tuple[str, str]], nprocs: int, timeouts: dict | None = None,
              timeout: float | None = None, env: dict | None = None) -> ModuleRun:
    """:func:`run_module` for ``(module file, function name)`` cases of one or more modules (a
    module's cases together), ``timeouts`` and results by :func:`case_id`.

    Each rank imports a module just before its first case and, after its last, puts back what a
    module may change for the whole process (environment, working directory, torch's default dtype,
    threads, determinism, grad mode and generator, warning filters)."""
    timeouts = timeouts or {}
    ids = [case_id(p, n) for p, n in cases]
    if timeout is None:
        timeout = startup_allowance(nprocs) + sum(timeouts.get(c, DEFAULT_TIMEOUT) for c in ids)
    with tempfile.TemporaryDirectory(prefix="hpcpar-mpitest-") as tmp:
        listing = os.path.join(tmp, "cases.json")
        with open(listing, "w") as fh:
            json.dump(ids, fh)
        cmd = [find_mpiexec(), "-n", str(nprocs), sys.executable, "-m",
               "hpcpar.testing.worker", listing, tmp]
        start = time.monotonic()
        with tempfile.TemporaryFile("w+", errors="replace") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env=rank_env(env), start_new_session=True, text=True,
                                    preexec_fn=_die_with_parent())
            try:
                timed_out, hung = _wait(proc, tmp, nprocs, timeouts, start + timeout)
            except BaseException:   # interrupted (pytest-timeout, ^C): take the ranks along
                _kill_group(proc)
                raise
            if timed_out:
                _kill_group(proc)
            out.seek(0)
            output = out.read()
        elapsed = time.monotonic() - start
        results = _collect(tmp, nprocs, ids, timed_out, timeout, proc.returncode, hung, timeouts)
    paths = sorted({p for p, _ in cases})
    return ModuleRun(paths[0] if len(paths) == 1 else "", nprocs, results, proc.returncode,
                     output or "", timed_out, elapsed)


def _die_with_parent() -> Callable[[], None] | None:
    """What the child runs before exec so that the kernel sends ``mpiexec`` SIGTERM when the
    process that launched it dies (its ranks go with it, as on ^C): a killed test run leaves
    no ranks spinning. Looked up here, in the parent: a forked child must not load libraries.
    None where there is no ``prctl`` (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _wait(proc: subprocess.Popen, tmp: str, nprocs: int, timeouts: dict,
          deadline: float) -> tuple[bool, str | None]:
    """Wait for the launch to end, looking at the ranks' progress meanwhile. Returns (False,
    None) when it ended; else (it is still running: True and) the case that outlived its own
    timeout, or None when the whole launch outlived ``deadline``."""
    entered: dict[str, float] = {}    # case -> when the last rank entered it
    while True:
        try:
            proc.wait(timeout=_POLL)
            return False, None
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now > deadline:
            return True, None
        started, inside = _progress(tmp, nprocs)
        for case in set(inside.values()):
            if all(case in started.get(r, ()) for r in range(nprocs)):
                entered.setdefault(case, now)
            if case in entered and now - entered[case] > timeouts.get(case, DEFAULT_TIMEOUT):
                return True, case


def _progress(tmp: str, nprocs: int) -> tuple[dict[int, set[str]], dict[int, str]]:
    """(rank -> the cases it started, rank -> the case it is inside) from its progress file."""
    started: dict[int, set[str]] = {}
    inside: dict[int, str] = {}
    for r in range(nprocs):
        for rec in _read_json_lines(os.path.join(tmp, f"rank{r}.jsonl")):
            if rec.get("event") == "start":
                started.setdefault(r, set()).add(rec["case"])
                inside[r] = rec["case"]
            elif inside.get(r) == rec.get("case"):
                inside.pop(r)
    return started, inside


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_json_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            with suppress(json.JSONDecodeError):   # a line still being written
                if line.strip():
                    out.append(json.loads(line))
    return out


def _collect(tmp: str, nprocs: int, cases: list[str], timed_out: bool, timeout: float,
             returncode, hung: str | None = None, timeouts: dict | None = None) -> dict:
    """Case -> its result; ``hung``: the case killed at its own timeout (else a timeout
    was the whole launch's)."""
    per_case: dict[str, dict[int, dict]] = {c: {} for c in cases}
    for r in range(nprocs):
        for rec in _read_json_lines(os.path.join(tmp, f"rank{r}.jsonl")):
            if rec.get("event") != "start" and rec.get("case") in per_case:
                prev = per_case[rec["case"]].get(r)
                if prev is None or prev["status"] != "failed":
                    per_case[rec["case"]][r] = rec
    progress = _progress(tmp, nprocs)[1]
    results = {}
    for c in cases:
        recs = per_case[c]
        failed = {r: v["traceback"] for r, v in recs.items() if v["status"] == "failed"}
        skipped = {r: v.get("message", "") for r, v in recs.items() if v["status"] == "skipped"}
        dur = max((v.get("duration", 0.0) for v in recs.values()), default=0.0)
        inside = sorted(r for r, cc in progress.items() if cc == c)
        if failed:
            results[c] = CaseResult(c, "failed", f"failed on rank(s) {sorted(failed)}", failed, dur)
        elif len(recs) == nprocs and len(skipped) == nprocs:
            results[c] = CaseResult(c, "skipped", next(iter(skipped.values())), skipped, dur)
        elif len(recs) == nprocs and skipped:  # a test that ran on only some ranks checked
            ran = sorted(set(recs) - set(skipped))  # nothing there; it must not pass
            results[c] = CaseResult(
                c, "failed", f"skipped on rank(s) {sorted(skipped)} but ran on rank(s) {ran}: "
                f"a skip must be the same on every rank ({next(iter(skipped.values()))})",
                skipped, dur)
        elif len(recs) == nprocs:
            results[c] = CaseResult(c, "passed", "", {}, dur)
        elif timed_out and (inside or recs):
            done = sorted(recs)
            limit = (f"its {(timeouts or {}).get(c, DEFAULT_TIMEOUT):.0f} s timeout"
                     if c == hung else f"the launch's {timeout:.0f} s timeout")
            results[c] = CaseResult(c, "timeout", f"killed at {limit}: rank(s) {inside} still "
                                    f"inside this case, rank(s) {done} had finished it", {}, dur)
        elif inside:
            results[c] = CaseResult(
                c, "failed", f"the job ended (exit code {returncode}) while rank(s) {inside} "
                "were inside this case (a rank crashed or was killed)", {}, dur)
        else:
            why = "timed out before it started" if timed_out else \
                f"the job ended (exit code {returncode}) before it started"
            results[c] = CaseResult(c, "not-run", why, {}, 0.0)
    return results
