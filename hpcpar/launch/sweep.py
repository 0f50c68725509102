"""Sweep planning: the (ranks, grid, --set) points of a scaling study, validated up front.

Grid of a point (:func:`point_grid`): keep the job's spatial axes (x, y, z) when their product
divides N; otherwise shrink the largest spatial axis (z first on ties) by its smallest prime
factor until it does; the data axis takes the rest. Weak scaling grows the global batch with N:
B(N) = B0 * N / N0 (N0 the smallest count of the sweep), so the work per rank stays constant.
Every point runs with the same threads per rank (``--threads``, else the rule of
:func:`hpcpar.launch.threads.threads_per_rank` decided once for the whole sweep), so the 1-rank
baseline computes exactly as each rank of the other points does.

A sweep owns its output directory while it runs (:func:`sweep_lock`: ``OUT/hpcpar.lock``, the run
directories' lock), so a second sweep into the same ``--out`` is refused at once instead of
overwriting the first one's logs and moving its finished runs aside; and it uses only a directory
that is new, empty or marked as a sweep's (the lock's holder marks it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hpcpar.errors import ConfigError, HpcparError, LaunchError
from hpcpar.formats.jobspec import load_job
from hpcpar.launch.threads import thread_env, threads_per_rank

__all__ = ["parse_ranks", "point_grid", "plan", "sweep_lock", "run_command", "run_points",
           "submit_command"]

SWEEP_FILE = "sweep.json"  # the sweep's plan, written into OUT when it starts
SUBMIT_RECORDS = "jobs.json"  # hpcpar submit's records: a sweep submitted to Slurm


def parse_ranks(text: str, flag: str = "--ranks") -> list[int]:
    """Parse a comma-separated ``--ranks`` (or ``--nodes``: ``flag``) list such as ``"1,2,4"`` into
    sorted distinct counts; :class:`ConfigError` unless positive integers."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    # ASCII digits only (int() also takes other scripts' digits), and a sane count
    if not items or not all(t.isascii() and t.isdigit() and len(t) <= 9 for t in items):
        raise ConfigError(f"{flag} {text!r}: expected a count such as 4 or a comma-separated "
                          f"list such as 1,2,4")
    ranks = sorted({int(t) for t in items})
    if ranks[0] < 1:
        raise ConfigError(f"{flag} {text!r}: expected positive counts such as 1,2,4")
    return ranks


def _smallest_factor(n: int) -> int:
    return next(f for f in range(2, n + 1) if n % f == 0)


def point_grid(job_shape: Sequence[int], n: int) -> tuple[int, int, int, int]:
    """The ``(data, x, y, z)`` grid of a sweep point of ``n`` ranks from the job's (a -1 spatial
    axis counts as 1): the spatial axes stay while X*Y*Z divides N, else the largest one (on ties z,
    then y: x groups stay inside a node) shrinks by its smallest prime factor until it does; data =
    N / (X*Y*Z)."""
    spatial = [max(1, int(a)) for a in tuple(job_shape)[1:]]
    while n % (spatial[0] * spatial[1] * spatial[2]):
        i = max(range(3), key=lambda a: (spatial[a], a))  # ties: z, then y, then x
        spatial[i] //= _smallest_factor(spatial[i])
    x, y, z = spatial
    return (n // (x * y * z), x, y, z)


def plan(job_path: str, ranks: list[int], weak: bool, sets: Sequence[str],
         threads: int | None = None) -> list[dict]:
    """Plan a scaling sweep: one ``{"ranks", "grid", "sets", "threads"}`` dict per point, every
    point validated before any runs (:class:`ConfigError` naming a point whose job does not
    validate, or a weak-scaling batch that is not an integer). ``weak`` grows the global batch as
    ``B0 * N / N0``; ``threads`` per rank default to ``OMP_NUM_THREADS``, else ``[resources]
    cpus_per_task``."""
    job = load_job(job_path, list(sets))
    base_batch = job.train.global_batch
    threads = threads or threads_per_rank(job.resources.cpus_per_task)
    points = []
    for n in ranks:
        grid = point_grid(job.grid_shape, n)
        spec = "x".join(map(str, grid))
        point_sets = list(sets)
        if weak:
            if (base_batch * n) % ranks[0]:
                raise ConfigError(f"--weak: global batch {base_batch} x {n}/{ranks[0]} ranks is "
                                  f"not an integer; use rank counts that are multiples of "
                                  f"{ranks[0]}")
            point_sets.append(f"train.global_batch={base_batch * n // ranks[0]}")
        try:
            grid_sets = [f"grid.{a}={v}" for a, v in zip(("data", "x", "y", "z"), grid)]
            load_job(job_path, point_sets + grid_sets).check_ranks(n)
        except HpcparError as exc:
            raise ConfigError(f"sweep point {n} ranks (grid {spec}): {exc}") from None
        points.append({"ranks": n, "grid": spec, "sets": point_sets, "threads": threads})
    return points


#: what a sweep (and ``hpcpar submit``) writes into its ``--out``: listed in the directory's
#: mark (:func:`hpcpar.formats.rundir.write_mark`)
SWEEP_ENTRIES = (SWEEP_FILE, SUBMIT_RECORDS, "jobs.json.tmp", "ranks-*", "report", "slurm")


def _old_sweep(out: Path) -> bool:
    """A sweep directory of an hpcpar before the mark: its ``sweep.json`` plan or its submit
    records (JSON objects of the shape hpcpar writes)."""
    from hpcpar.formats.rundir import read_json_file  # deferred: loads filelock (CLI --help)

    return ("points" in read_json_file(out / SWEEP_FILE)
            or isinstance(read_json_file(out / SUBMIT_RECORDS).get("jobs"), list))


def check_sweep_dir(out: Path) -> None:
    """Refuse (read-only, :class:`LaunchError`) an ``--out`` that is a file, or a non-empty
    directory without a sweep's mark (``hpcpar-run.json``, which only a sweep writes), so a sweep
    never writes its logs, runs and report among a user's files."""
    from hpcpar.formats.rundir import MARK_NAME, owned_dir  # deferred: loads filelock (CLI --help)

    if not out.exists():
        if out.is_symlink():
            raise LaunchError(f"--out {out}: a symbolic link to nothing (dangling or a loop)")
        return
    if not out.is_dir():
        raise LaunchError(f"--out {out}: exists and is not a directory")
    if owned_dir(out, "sweep", SWEEP_ENTRIES, _old_sweep):
        return
    names = sorted(p.name for p in out.iterdir())
    raise LaunchError(f"--out {out}: not a sweep directory (it holds {names[0]!r}"
                      + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                      + f" and no {MARK_NAME}, which hpcpar sweep writes); choose a new or "
                        f"empty directory")


@contextmanager
def sweep_lock(out: Path, warn: Callable[[str], object] = print) -> Iterator[None]:
    """Hold ``OUT/hpcpar.lock`` while a sweep runs, creating ``out`` when missing.

    A stale lock is taken over with a warning through ``warn``; another live sweep (or run) holding
    ``out`` raises :class:`RunDirError`: one line naming its pid, host and start time."""
    from hpcpar.formats.rundir import RunLock  # deferred: loads filelock (CLI --help)

    check_sweep_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out, warn=warn, what="sweep", option="--out", entries=SWEEP_ENTRIES)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


# -- running the points, one after the other -----------------------------------------------
def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_command(job_path: str, point: dict, run_dir: Path, resume: bool = False) -> list[str]:
    """``hpcpar run`` of one point (fresh unless ``resume``: old files are set aside)."""
    cmd = [sys.executable, "-m", "hpcpar.cli", "run", str(job_path), "-n", str(point["ranks"]),
           "--grid", point["grid"], "--run-dir", str(run_dir),
           "--resume" if resume else "--no-resume"]
    for s in point["sets"]:
        cmd += ["--set", s]
    return cmd


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_points(job_path, points, out: Path, verbose: bool, resume: bool = False,
               say: Callable[[str], object] = print,
               warn: Callable[[str], object] = _stderr) -> list[int]:
    """Run the points one after the other, each with its threads per rank; returns the rank
    counts that failed."""
    failed = []
    for point in points:
        run_dir = out / f"ranks-{point['ranks']}"
        log = out / f"ranks-{point['ranks']}.log"
        cmd = run_command(job_path, point, run_dir, resume)
        env = dict(os.environ, **thread_env(point["threads"]))
        say(f"sweep: {point['ranks']} rank(s), grid {point['grid']}, "
                   f"{point['threads']} thread(s) per rank -> {run_dir}")
        t0 = time.monotonic()
        with open(log, "w") as fh:
            if verbose:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace", env=env)
                assert proc.stdout is not None  # stdout=PIPE
                for line in proc.stdout:
                    fh.write(line)
                    say(f"  {line.rstrip(chr(10))}")
                rc = proc.wait()
            else:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
        took = time.monotonic() - t0
        if rc == 0:
            say(f"sweep: {point['ranks']} rank(s) done in {took:.1f} s (log {log})")
        else:
            failed.append(point["ranks"])
            warn(f"sweep: {point['ranks']} rank(s) FAILED with exit code {rc} after "
                 f"{took:.1f} s; last lines of {log}:\n{_tail(log)}")
    return failed


def submit_command(job_path, out, ranks, weak, sets) -> list[str]:
    """``hpcpar submit`` of the whole sweep (``sweep --submit``), the report included."""
    cmd = [sys.executable, "-m", "hpcpar.cli", "submit", str(job_path), "--out", str(out),
           "--ranks", ",".join(map(str, ranks)), "--report"]
    if weak:
        cmd.append("--weak")
    for s in sets:
        cmd += ["--set", s]
    return cmd
