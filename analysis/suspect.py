"""What in a run's records cannot be taken as a measurement, found before any statistic.

A report is only as good as its records: a step time of zero, below zero or infinite (a
clock that jumped, a hand-edited or corrupted file) would become a negative or infinite
speedup, and runs of different hpcpar versions may not time the same work. Impossible steps
are left out with a note (the run then shows as partial); mixed versions are a warning line
the report prints and shows (they are not refused: comparing versions is a legitimate use).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from hpcpar.formats.records import COLUMNS

__all__ = ["MEASURED", "impossible_steps", "version_warning"]

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
