"""What in a run's records cannot be taken as a measurement, found before any statistic.

A report is only as good as its records: a step time of zero, below zero or infinite (a
clock that jumped, a hand-edited or corrupted file) would become a negative or infinite
speedup, and runs of different hpcpar versions may not time the same work. Impossible steps
are left out with a note (the run then shows as partial); mixed versions are a warning line
the report prints and shows (they are not refused: comparing versions is a legitimate use).

A point that beats the cores it used (efficiency above 1, or a speedup above the ratio of
cores used, ranks x threads per rank) is flagged after the statistics, with its likely cause
(:func:`superlinear`): a baseline that ran other threads per rank, was oversubscribed or shared
a busy host usually explains it before any cache effect does.
"""

from __future__ import annotations

import math
from typing import TypeGuard

import numpy as np
import pandas as pd

from hpcpar.formats.records import COLUMNS

__all__ = ["MEASURED", "BUSY_LOAD", "BUSY_MARGIN", "impossible_steps", "version_warning",
           "superlinear", "superlinear_warnings", "busy_host"]

#: Step columns that are amounts (seconds, bytes, samples), ``t_step`` first: each must be
#: finite and >= 0 where recorded (an empty cell is a phase the run did not measure);
#: ``t_step`` must be > 0.
MEASURED = ("t_step", *(c.name for c in COLUMNS
                        if c.unit in ("s", "B", "samples") and c.name != "t_step"))


def impossible_steps(steps: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Drop every step in which some rank recorded an impossible amount.

    A step is impossible when any rank's ``t_step`` is not a finite number > 0, or any other
    measured amount is negative or infinite. The whole step goes (every rank's row): a step
    time is a maximum over ranks, so one rank's garbage would decide it.

    Args:
        steps: One run's step records (one row per rank per step).

    Returns:
        ``(kept, notes)``: the plausible steps, and one note naming the first impossible value
        and how many steps were left out (empty when all are plausible).
    """
    amounts = steps[list(MEASURED)].apply(pd.to_numeric, errors="coerce")
    values = amounts.to_numpy(float)
    bad = np.isinf(values) | (values < 0)
    t_step = amounts["t_step"].to_numpy(float)
    bad[:, 0] |= ~(np.isfinite(t_step) & (t_step > 0))
    rows = bad.any(axis=1)
    if not rows.any():
        return steps, []
    first = int(np.flatnonzero(rows)[0])
    column = MEASURED[int(np.flatnonzero(bad[first])[0])]
    gone = steps.loc[rows, "step"].unique()
    note = (f"{len(gone)} step(s) with an impossible {column} ignored (first: step "
            f"{steps['step'].iloc[first]} rank {steps['rank'].iloc[first]} recorded {column} "
            f"= {steps[column].iloc[first]})")
    return steps[~steps["step"].isin(gone)], [note]


def version_warning(runs: pd.DataFrame) -> str | None:
    """One line naming the hpcpar versions when the runs were recorded by more than one.

    Args:
        runs: The run table (``hpcpar_version`` column; None: not recorded).

    Returns:
        The warning, or None when all runs share one version.
    """
    versions = runs["hpcpar_version"].fillna("unrecorded").astype(str)
    if versions.nunique() < 2:
        return None
    parts = []
    for version, names in runs["name"].groupby(versions, sort=True):
        shown = ", ".join(names.iloc[:3]) + (" ..." if len(names) > 3 else "")
        parts.append(f"{version} ({len(names)} run(s): {shown})")
    return ("runs recorded by different hpcpar versions: " + "; ".join(parts)
            + "; their step times may not time the same work")


#: 1-minute load average above which the host counts as busy when a baseline ran
BUSY_LOAD = 0.5
#: Load beyond what a point leaves idle (or, at its end, beyond what its own ranks explain)
#: that marks its host busy: a whole core's worth of other work.
BUSY_MARGIN = 1.0


def _known(v) -> TypeGuard[float]:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def busy_host(before: float | None, after: float | None, cores: float | None,
              ranks_per_node: float | None, threads: float | None) -> bool | None:
    """Whether other work shared a point's cores, from the host's 1-minute load average.

    Busy when the load before the run exceeded the cores the point left idle (cores - ranks
    per node x threads) by more than :data:`BUSY_MARGIN`, or the load at its end exceeded by
    as much what the point's own ranks can account for (its ranks x threads, at least the
    cores). Such a point times CPU sharing, like an oversubscribed one. The margin of a whole
    core keeps the fading load of a sweep's previous point (a 1-minute average) from counting.

    Args:
        before: The largest 1-minute load when the point's runs began (NaN: not recorded).
        after: The largest 1-minute load when they ended.
        cores: Cores per node.
        ranks_per_node: The point's ranks per node.
        threads: Threads per rank.

    Returns:
        True / False, or None when the load or the cores were not recorded.
    """
    if not _known(cores) or not (_known(before) or _known(after)):
        return None
    used = ranks_per_node * (threads if _known(threads) else 1) if _known(ranks_per_node) \
        else cores
    return bool((_known(before) and before > max(0.0, cores - used) + BUSY_MARGIN)
                or (_known(after) and after > max(cores, used) + BUSY_MARGIN))


def _cause(row: dict, base: dict, load: dict) -> str:
    """The likely cause of one point beating its cores, most telling first."""
    p0, t0, t = base["ranks"], base["threads_per_rank"], row["threads_per_rank"]
    if _known(t0) and _known(t) and t0 != t:
        return (f"the baseline ({p0} ranks) ran {t0:.0f} thread(s) per rank, this point "
                f"{t:.0f}: not like for like (hpcpar sweep --threads N runs every point alike)")
    if base["oversubscribed"] is True:
        return (f"the baseline ({p0} ranks) was oversubscribed (ranks x threads > cores): it "
                f"timed CPU sharing")
    before = load.get(p0)
    if _known(before) and before > BUSY_LOAD:
        cores = base["cores_per_node"]
        on = f" on {cores:.0f} cores" if _known(cores) else ""
        return (f"the host was busy when the baseline ran (load {before:.1f}{on} before it): "
                f"other processes took CPU from it; rerun on a quiet host")
    lo, hi = row["efficiency_lo"], row["efficiency_hi"]
    if _known(lo) and lo <= 1:
        return f"timing noise: the efficiency's 95% interval [{lo:.2f}, {hi:.2f}] includes 1"
    return ("a superlinear effect (each rank's share of the data fits a faster cache) or a "
            "baseline slowed by something the records do not show; rerun the baseline")


def superlinear(table: pd.DataFrame, runs: pd.DataFrame) -> list[str]:
    """Flag each point whose speedup beats the cores it used, naming the likely cause.

    A point beats its cores when its efficiency E = S / q is above 1, or its speedup S is
    above the ratio of cores used, (p x threads per rank) / (p0 x the baseline's threads).

    Args:
        table: The scaling table (speedup, efficiency and its interval, baseline_ranks,
            threads_per_rank, cores_per_node, oversubscribed per point).
        runs: The run table (``load_before``: the host's 1-minute load when each run began).

    Returns:
        One text per row of ``table``: ``""``, or ``"SUSPECT: ..."`` with the cause.
    """
    load = {}
    if "load_before" in runs:
        before = pd.to_numeric(runs["load_before"], errors="coerce")
        load = {(c, int(p)): v for (c, p), v in before.groupby([runs["config"],
                                                                runs["ranks"]]).max().items()}
    rows = table.to_dict("records")
    base_of = {(r["config"], r["ranks"]): r for r in rows}
    out = []
    for r in rows:
        S, E = r["speedup"], r["efficiency"]
        base = base_of.get((r["config"], r["baseline_ranks"]))
        if base is None or base is r or not (_known(S) and _known(E)):
            out.append("")
            continue
        t0, t = base["threads_per_rank"], r["threads_per_rank"]
        cores = r["ideal_speedup"] * (t / t0 if _known(t0) and _known(t) and t0 else 1.0)
        if not (E > 1 or S > cores):
            out.append("")
            continue
        loads = {p: v for (c, p), v in load.items() if c == r["config"]}
        out.append(f"SUSPECT: speedup {S:.2f}x (efficiency {E:.2f}) on {cores:.3g}x the "
                   f"baseline's cores; likely cause: {_cause(r, base, loads)}")
    return out


def superlinear_warnings(table: pd.DataFrame) -> list[str]:
    """The report's warning line of each point flagged in the table's ``suspect`` column.

    Args:
        table: The scaling table.

    Returns:
        ``"CONFIG @ P ranks: SUSPECT: ..."`` per flagged point.
    """
    flagged = table[table["suspect"].fillna("").astype(str) != ""]
    return [f"{c} @ {p} ranks: {s}" for c, p, s in
            zip(flagged["config"], flagged["ranks"], flagged["suspect"])]
