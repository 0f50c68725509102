"""What the benchmarks that judge a parallel path against the machine's own limit share.

The limit of a P-way split is measured in the same run: the same work split the same way,
P processes at once on the same cores, each running the fastest single-process form on its
own piece with no halo and no messages. Busy cores share caches, memory bandwidth and the
host, so no split can beat it; a path is judged as ``limit time / path time`` per round, and
since the host drifts between rounds only the median over alternating rounds, printed with
its min-max spread, means anything.

Imported by its siblings (``from limits import ...``): a benchmark runs as a script, so its
folder is first on ``sys.path``.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time


def quiet_barrier(comm) -> None:
    """A barrier that sleeps while waiting, so it leaves the cores to ranks still working."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def spread(values) -> str:
    """``min-max`` of a few values (``-`` for one: a single round has no spread)."""
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else "-"


def fraction(limit_times, times) -> str:
    """The path's fraction of its limit, ``limit / path`` per round: ``median (min-max)``."""
    ratios = [a / b for a, b in zip(limit_times, times)]
    return f"{statistics.median(ratios):.2f} ({spread(ratios)})"


def verdict(limit_times, times, target: float | None) -> str:
    """``; target >= T: met`` (or ``not met``) for the median fraction, empty with no target."""
    if target is None:
        return ""
    met = statistics.median(a / b for a, b in zip(limit_times, times)) >= target
    return f"; target >= {target:.2f}: {'met' if met else 'not met'}"


def command(ranks: int | None = None) -> str:
    """The command line that reproduces this run (under ``mpiexec -n ranks`` when given)."""
    launch = ["mpiexec", "-n", str(ranks)] if ranks else []
    return shlex.join([*launch, "python", *sys.argv])


def write_json(path: str | None, record: dict) -> None:
    """Write ``record`` (the command, the settings and every round) to ``path``, if given."""
    if path:
        with open(path, "w") as fh:
            json.dump(record, fh, indent=1)
