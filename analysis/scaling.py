"""The scaling table: one row per (config, ranks), built from the statistics in ``stats``.

Runs are grouped by their ``config`` label (meta ``config``, default the job name); several
runs of one config at the same rank count are pooled. The baseline of a config is its smallest
rank count with usable steps. Strong or weak scaling is read from the work per step
W = global batch x problem size: W constant -> strong, W proportional to p -> weak, anything
else -> "mixed" (speedup is then the work-rate ratio); ``mode=`` overrides the choice.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import stats

MODES = ("strong", "weak")

#: Columns of scaling.csv, in order.
TABLE_COLUMNS = (
    "config", "ranks", "nodes", "grid", "mode", "baseline_ranks", "runs", "steps",
    "t_step_median", "t_step_mean", "t_step_std", "t_step_cv", "throughput",
    "samples_per_step", "speedup", "ideal_speedup", "efficiency", "karp_flatt",
    "amdahl_serial_fraction", "amdahl_speedup",
    *(f"frac_{p}" for p in stats.PHASES), *(f"t_{p}" for p in stats.PHASES), "imbalance",
    "bytes_halo_per_step", "bytes_allreduce_per_step", "bytes_read_per_step", "peak_mem_max",
    "partial", "note",
)


def detect_mode(ratios: dict, tol: float = 1e-6) -> str:
    """'strong' if W(p)/W(p0) = 1 for every p, 'weak' if it equals p/p0, 'mixed' otherwise,
    'unknown' when the work per step is not recorded. ``ratios``: q -> W(p)/W(p0)."""
    values = [(q, r) for q, r in ratios.items() if q != 1]
    if any(not np.isfinite(r) for _, r in values):
        return "unknown"
    if all(abs(r - 1) <= tol for _, r in values):
        return "strong"
    if all(abs(r - q) <= tol * q for q, r in values):
        return "weak"
    return "mixed"


def _point(runs: pd.DataFrame, steps: pd.DataFrame) -> dict:
    """Statistics of one (config, ranks) group (its runs and kept steps)."""
    T = stats.step_time(steps)
    N = stats.global_samples(steps, runs.set_index("run")["spatial_size"])
    per_step = steps.groupby(["run", "step"])
    row = {
        "nodes": runs["nodes"].max(), "grid": "/".join(sorted(set(runs["grid_spec"].dropna()))),
        "runs": len(runs), "steps": len(T), "t_step_median": stats.median(T),
        "t_step_mean": stats.mean(T), "t_step_std": stats.std(T), "t_step_cv": stats.cv(T),
        "throughput": stats.throughput(N, T), "samples_per_step": stats.median(N),
        **stats.fractions(steps),
        **{f"t_{k}": v for k, v in stats.phase_per_step(steps).items()},
        "imbalance": stats.imbalance(steps),
        **{f"{c}_per_step": stats.median(per_step[c].sum(min_count=1))
           for c in ("bytes_halo", "bytes_allreduce", "bytes_read")},
        "peak_mem_max": float(steps["peak_mem"].max()) if len(steps) else math.nan,
    }
    notes = [f"{name}: {note}" for name, note in zip(runs["name"], runs["note"]) if note]
    if len(T) == 0 and not notes:
        notes.append("no steps left after warm-up")
    row["partial"] = bool(notes) or len(T) == 0
    row["note"] = "; ".join(notes)
    if np.isnan(row["samples_per_step"]):  # no samples recorded: the job's global batch
        batch = pd.to_numeric(runs["global_batch"], errors="coerce").median()
        row["samples_per_step"] = batch
    return row


def _work(runs: pd.DataFrame, samples: float) -> float:
    size = pd.to_numeric(runs["problem_size"], errors="coerce").median()
    return samples * (size if np.isfinite(size) else 1.0)


def scaling_table(runs: pd.DataFrame, steps: pd.DataFrame, mode: str | None = None,
                  warmup=None) -> pd.DataFrame:
    """One row per (config, ranks) with :data:`TABLE_COLUMNS` (see the module docstring).

    ``steps`` still holds warm-up steps (from :func:`hpcpar.analysis.load`); they are dropped
    here with ``warmup`` (see :func:`stats.drop_warmup`)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
    steps = stats.drop_warmup(steps, runs, warmup) if len(steps) else steps
    rows = []
    for config, cruns in runs.groupby("config", sort=True):
        points = {}
        for p, pruns in cruns.groupby("ranks"):
            psteps = steps[steps["run"].isin(pruns["run"])] if len(steps) else steps
            points[int(p)] = {"config": config, "ranks": int(p),
                              **_point(pruns, psteps), "_work": None}
            points[int(p)]["_work"] = _work(pruns, points[int(p)]["samples_per_step"])
        rows += _relative(points, mode)
    table = pd.DataFrame(rows)
    for col in TABLE_COLUMNS:
        if col not in table:
            table[col] = np.nan
    return table[list(TABLE_COLUMNS)].reset_index(drop=True)


def _relative(points: dict, mode: str | None) -> list[dict]:
    """Speedup, efficiency, Karp-Flatt and the Amdahl fit of one config's points."""
    usable = [p for p, r in sorted(points.items()) if np.isfinite(r["t_step_median"])]
    if not usable:
        for r in points.values():
            r.update(mode=mode or "unknown", note=r["note"] or "no usable steps")
        return [points[p] for p in sorted(points)]
    p0 = usable[0]
    base = points[p0]
    ratios = {p / p0: points[p]["_work"] / base["_work"] for p in usable}
    detected = detect_mode(ratios)
    chosen = mode or detected
    for p in sorted(points):
        r, q = points[p], p / p0
        work_ratio = {"strong": 1.0, "weak": q}.get(chosen, ratios.get(q, math.nan))
        if chosen == "unknown":
            work_ratio = 1.0
        S = stats.speedup(r["t_step_median"], base["t_step_median"], work_ratio)
        notes = [r["note"]] if r["note"] else []
        if chosen == "unknown":
            notes.append("work per step not recorded: strong scaling assumed")
        elif chosen == "mixed":
            notes.append("work per step varies irregularly with ranks: speedup = work-rate "
                         "ratio")
        elif mode and detected not in (mode, "unknown") and p != p0:
            notes.append(f"{mode} scaling forced; the runs look {detected}")
        if base["partial"] and p != p0:
            notes.append(f"baseline ({p0} ranks) is partial")
        r.update(mode=chosen, baseline_ranks=p0, ideal_speedup=q, speedup=S,
                 efficiency=stats.efficiency(S, q), karp_flatt=stats.karp_flatt(S, q),
                 note="; ".join(notes), partial=r["partial"] or base["partial"])
    f = stats.amdahl_fit([p / p0 for p in usable], [points[p]["speedup"] for p in usable])
    for p, r in points.items():
        r["amdahl_serial_fraction"] = f
        r["amdahl_speedup"] = float(stats.amdahl_speedup(f, p / p0)) if np.isfinite(f) else math.nan
        r.pop("_work")
    return [points[p] for p in sorted(points)]
