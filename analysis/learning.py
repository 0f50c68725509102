"""The learning view: did every point of a scaling study learn the same thing?

A parallel run that is fast but learns something else is no result, so the report shows each
run's training-loss and validation curves (from ``RUN/metrics.json``: ``train_loss_history``,
``validation_history`` and the final values) beside the timings, and a verdict comparing each
point's final loss with its config's baseline point. The comparison is against the run-to-run
spread of repeated points where a point was repeated (the noise the study itself shows), else
against a stated relative tolerance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

__all__ = ["TOLERANCE", "FLOOR", "LEARNING_COLUMNS", "read_metrics", "learning_curves",
           "learning_table", "learning_verdict"]

#: Relative difference of final losses accepted when no point was repeated: two runs of one
#: job on different rank counts differ only in floating-point summation order.
TOLERANCE = 0.02
#: The least tolerance (relative) when repeats set it: identical repeats (a fixed seed) would
#: otherwise make any rounding difference a flag.
FLOOR = 0.001

#: Columns of learning.csv (one row per config and rank count).
LEARNING_COLUMNS = ("config", "ranks", "runs", "steps", "final_loss", "final_val_loss",
                    "metric", "final_metric", "loss_diff", "tolerance", "learnt_same")


def read_metrics(run_dir: str | Path) -> dict | None:
    """A run's ``metrics.json`` as a dict; None when missing or unreadable (a run that did
    not finish, or records written without training)."""
    try:
        data = json.loads((Path(run_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _metric(m: dict) -> tuple[str | None, float | None]:
    """The run's headline metric: its first final validation (else test) metric that is not
    the loss, e.g. ``val_mae`` or ``val_acc``."""
    for prefix in ("val_", "test_"):
        for k in sorted(m):
            if k.startswith(prefix) and not k.endswith("_loss") and _finite(m[k]):
                return k, float(m[k])
    return None, None


def learning_curves(runs: pd.DataFrame) -> pd.DataFrame:
    """Every run's training and validation loss curves, one row per recorded point.

    Args:
        runs: The run table (``run``, ``config``, ``ranks``, ``global_batch``).

    Returns:
        Columns ``run``, ``config``, ``ranks``, ``curve`` ("train" or "val"), ``step``,
        ``samples`` (samples seen: step x global batch; NaN when the batch is unknown) and
        ``loss``. The final validation (``val_loss`` after the last step) ends the val curve.
    """
    rows = []
    for r in runs.to_dict("records"):
        m = read_metrics(r["run"])
        if m is None:
            continue
        batch = r["global_batch"] if _finite(r["global_batch"]) else math.nan
        points = [("train", s, v) for s, v in _pairs(m.get("train_loss_history"))]
        points += [("val", h.get("step"), h.get("val_loss"))
                   for h in m.get("validation_history") or [] if isinstance(h, dict)]
        if _finite(m.get("val_loss")) and _finite(m.get("steps")):
            points.append(("val", m["steps"], m["val_loss"]))
        rows += [{"run": r["run"], "config": r["config"], "ranks": r["ranks"], "curve": c,
                  "step": int(s), "samples": s * batch, "loss": float(v)}
                 for c, s, v in points if _finite(s) and _finite(v)]
    return pd.DataFrame(rows, columns=["run", "config", "ranks", "curve", "step", "samples",
                                       "loss"])


def _pairs(history) -> list:
    return [tuple(p) for p in history or [] if isinstance(p, (list, tuple)) and len(p) == 2]


def _per_run(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in runs.to_dict("records"):
        m = read_metrics(r["run"]) or {}
        name, value = _metric(m)
        rows.append({"config": r["config"], "ranks": r["ranks"],
                     "steps": m.get("steps") if _finite(m.get("steps")) else math.nan,
                     "final_loss": m.get("final_train_loss")
                     if _finite(m.get("final_train_loss")) else math.nan,
                     "final_val_loss": m.get("val_loss") if _finite(m.get("val_loss"))
                     else math.nan, "metric": name, "final_metric": value})
    return pd.DataFrame(rows, columns=["config", "ranks", "steps", "final_loss",
                                       "final_val_loss", "metric", "final_metric"])


def learning_table(runs: pd.DataFrame, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """One row per (config, ranks): final losses and metric (mean over the point's runs), the
    relative difference of its final loss from the config's baseline (smallest rank count)
    and whether that is within the tolerance.

    The tolerance of a config is the largest relative run-to-run range of final loss among
    its repeated points (at least :data:`FLOOR`) where a point has repeats, else
    ``tolerance``. The compared loss is the final validation loss where every point has one,
    else the final training loss.

    Args:
        runs: The run table.
        tolerance: The relative tolerance without repeats.

    Returns:
        A table with :data:`LEARNING_COLUMNS`; ``learnt_same`` is None where a point or its
        baseline recorded no loss.
    """
    per = _per_run(runs)
    out = []
    for config, c in per.groupby("config", sort=True):
        key = "final_val_loss" if c["final_val_loss"].notna().all() else "final_loss"
        pts = c.groupby("ranks", sort=True)
        ranges = [(g[key].max() - g[key].min()) / abs(g[key].mean())
                  for _, g in pts if g[key].notna().sum() > 1 and g[key].mean() != 0]
        tol = max(max(ranges), FLOOR) if ranges else tolerance
        base = None
        for ranks, g in pts:
            row = {"config": config, "ranks": ranks, "runs": len(g),
                   "steps": g["steps"].max(), **{k: g[k].mean() for k in
                                                 ("final_loss", "final_val_loss")},
                   "metric": g["metric"].dropna().iloc[0] if g["metric"].notna().any()
                   else None, "final_metric": pd.to_numeric(g["final_metric"]).mean(),
                   "tolerance": tol, "compared": key}
            value = row[key]
            if base is None and _finite(value):
                base = value
            diff = (value - base) / abs(base) if _finite(value) and base else math.nan
            row["loss_diff"] = diff
            row["learnt_same"] = bool(abs(diff) <= tol) if _finite(diff) else None
            out.append(row)
    return pd.DataFrame(out, columns=[*LEARNING_COLUMNS, "compared"])


def learning_verdict(learn: pd.DataFrame) -> str:
    """One line: per config, whether its points learnt the same (and how that was judged),
    naming each point that did not.

    Args:
        learn: The table of :func:`learning_table`.

    Returns:
        The line, starting "Learning:".
    """
    parts = []
    for config, t in learn.groupby("config", sort=True):
        if t["learnt_same"].isna().all():
            parts.append(f"{config}: no training metrics recorded (metrics.json)")
            continue
        what = "validation loss" if t["compared"].iloc[0] == "final_val_loss" else "train loss"
        tol = t["tolerance"].iloc[0]
        how = (f"within {tol:.2%} (the run-to-run spread of repeated points)"
               if (t["runs"] > 1).any() else f"within the stated tolerance {tol:.0%}")
        bad = t[t["learnt_same"] == False]  # noqa: E712 - None = not recorded
        if len(bad):
            flags = ", ".join(f"{p} ranks ({d:+.2%})" for p, d in zip(bad["ranks"],
                                                                     bad["loss_diff"]))
            parts.append(f"{config}: LEARNT DIFFERENTLY: final {what} off the "
                         f"{t['ranks'].iloc[0]}-rank point beyond {tol:.2%} at {flags}")
        else:
            parts.append(f"{config}: every point learnt the same (final {what} {how} of the "
                         f"{t['ranks'].iloc[0]}-rank point)")
        missing = t[t["learnt_same"].isna()]["ranks"].tolist()
        if missing:
            parts[-1] += f"; no loss recorded at {', '.join(map(str, missing))} ranks"
    return "Learning: " + " | ".join(parts) + "."
