"""Predicted vs measured: the planner's step time and phases beside the records'.

The prediction comes from a callable (``hpcpar report --plan MACHINE`` passes one built on
``hpcpar.plan``), so the analysis does not depend on the planner: ``predict_point(job,
grid)`` gets a run's meta.json ``job`` and its ``(data, x, y, z)`` grid and returns seconds
per step ``{"t_step", "t_compute", "t_halo", "t_comm_exposed", "t_io"}`` or raises
``HpcparError`` (the point's note then says why).

Measured phases are the table's per-rank means (``t_compute``, ``t_halo``,
``t_comm_exposed``, ``t_io``); ratio = measured / predicted (above 1: slower than the model).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd

from hpcpar.errors import HpcparError
from hpcpar.formats.records import read_meta

__all__ = ["PHASES", "PREDICTED_COLUMNS", "predicted_vs_measured"]

#: Phases compared (table column ``t_<phase>``; prediction key ``t_<phase>``).
PHASES = ("step", "compute", "halo", "comm_exposed", "io")
#: Columns of predicted.csv.
PREDICTED_COLUMNS = ("config", "ranks", "grid",
                     *(f"t_{p}_{w}" for p in PHASES for w in ("measured", "predicted")),
                     "ratio", "note")


def _grid(spec: str) -> tuple:
    return tuple(int(v) for v in str(spec).split("x"))


def predicted_vs_measured(table: pd.DataFrame, runs: pd.DataFrame,
                          predict_point: Callable[[dict, tuple], dict]) -> pd.DataFrame:
    """One row per point: measured and predicted seconds per step of the step and phases.

    Args:
        table: The scaling table.
        runs: The run table (the first run of each point gives the job and grid).
        predict_point: ``(job dict, grid) -> {"t_step", "t_compute", ...}``.

    Returns:
        ``PREDICTED_COLUMNS``; ratio = t_step_measured / t_step_predicted.
    """
    rows = []
    for r in table.to_dict("records"):
        mine = runs[(runs["config"] == r["config"]) & (runs["ranks"] == r["ranks"])]
        row = {"config": r["config"], "ranks": r["ranks"], "grid": r["grid"], "note": ""}
        for p in PHASES:
            row[f"t_{p}_measured"] = r["t_step_median"] if p == "step" else r[f"t_{p}"]
            row[f"t_{p}_predicted"] = math.nan
        try:
            if not len(mine):
                raise HpcparError("no run")
            first = mine.iloc[0]
            job = read_meta(first.get("run_dir") or first["run"]).get("job")
            if not isinstance(job, dict):
                raise HpcparError("the run recorded no job spec")
            pred = predict_point(job, _grid(first["grid_spec"]))
            for p in PHASES:
                row[f"t_{p}_predicted"] = float(pred.get(f"t_{p}", math.nan))
        except HpcparError as exc:
            row["note"] = f"no prediction: {exc}"
        m, q = row["t_step_measured"], row["t_step_predicted"]
        row["ratio"] = m / q if q and q == q and m == m else math.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=list(PREDICTED_COLUMNS))
