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

from hpcpar.errors import ConfigError

from . import stats
from .settings import split_unlike
from .suspect import busy_host, superlinear

__all__ = ["MODES", "TABLE_COLUMNS", "detect_mode", "scaling_table"]

MODES = ("strong", "weak")
_V1_PHASES = ("compute", "halo", "comm_exposed", "io", "other")
#: Bootstrap replicates of each point's median step time (intervals of speedup/efficiency).
N_BOOT = 1000

#: Columns of scaling.csv, in order.
TABLE_COLUMNS = (
    "config", "ranks", "nodes", "grid", "mode", "baseline_ranks", "runs", "steps",
    "t_step_median", "t_step_mean", "t_step_std", "t_step_cv", "throughput",
    "samples_per_step", "speedup", "ideal_speedup", "efficiency", "karp_flatt",
    "amdahl_serial_fraction", "amdahl_speedup",
    *(f"frac_{p}" for p in _V1_PHASES), *(f"t_{p}" for p in _V1_PHASES), "imbalance",
    "bytes_halo_per_step", "bytes_allreduce_per_step", "bytes_read_per_step", "peak_mem_max",
    "partial", "note",
    # added by the honest-report columns (issue 18); the ones above keep their meaning
    "frac_halo_comm", "frac_halo_local", "t_halo_comm", "t_halo_local", "unmeasured",
    "speedup_lo", "speedup_hi", "efficiency_lo", "efficiency_hi",
    "t_step_run_min", "t_step_run_max", "fit_law", "fit_serial_fraction", "fit_r2",
    "fit_shown", "fit_note",
    "cores_per_node", "ranks_per_node", "threads_per_rank", "oversubscribed",
    "settings_hash",
    # issue 32: a point that beats the cores it used, with its likely cause (suspect.py)
    "suspect",
    # issue 64: the host's 1-minute load before and at the end of the point's runs (the
    # largest over its runs), and whether other work shared its cores (suspect.busy_host)
    "load_before", "load_after", "busy_host",
)


def detect_mode(ratios: dict, tol: float = 1e-6) -> str:
    """Tell strong from weak scaling by the work per step.

    Args:
        ratios: q -> W(p)/W(p0), the work per step relative to the baseline.
        tol: Relative tolerance of the comparisons.

    Returns:
        ``"strong"`` if W(p)/W(p0) = 1 for every p, ``"weak"`` if it equals p/p0,
        ``"mixed"`` otherwise, ``"unknown"`` when the work per step is not recorded.
    """
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
    medians = T.groupby(level="run").median() if len(T) else pd.Series(dtype=float)
    row.update(_machine(runs), unmeasured=",".join(stats.unmeasured(steps)),
               t_step_run_min=float(medians.min()) if len(medians) else math.nan,
               t_step_run_max=float(medians.max()) if len(medians) else math.nan,
               settings_hash="/".join(sorted(set(runs["settings_hash"].dropna()))),
               _boot=stats.bootstrap_medians({r: t.to_numpy() for r, t in
                                              T.groupby(level="run")} if len(T) else {},
                                             N_BOOT))
    notes = [f"{name}: {note}" for name, note in zip(runs["name"], runs["note"]) if note]
    if len(T) == 0 and not notes:
        notes.append("no steps left after warm-up")
    row["partial"] = bool(notes) or len(T) == 0
    same = runs.get("settings_note", pd.Series(dtype=str)).fillna("")
    row["note"] = "; ".join(notes + sorted(set(n for n in same if n)))
    if np.isnan(row["samples_per_step"]):  # no samples recorded: the job's global batch
        batch = pd.to_numeric(runs["global_batch"], errors="coerce").median()
        row["samples_per_step"] = batch
    return row


def _machine(runs: pd.DataFrame) -> dict:
    """Machine facts of a point: the most crowded run's (oversubscribed if any run was)."""
    out = {}
    for k in ("cores_per_node", "ranks_per_node", "threads_per_rank"):
        v = pd.to_numeric(runs[k], errors="coerce") if k in runs else pd.Series(dtype=float)
        out[k] = v.max() if v.notna().any() else math.nan
    flags = runs["oversubscribed"].dropna() if "oversubscribed" in runs else []
    out["oversubscribed"] = bool(any(flags)) if len(flags) else None
    for k in ("load_before", "load_after"):
        v = pd.to_numeric(runs[k], errors="coerce") if k in runs else pd.Series(dtype=float)
        out[k] = v.max() if v.notna().any() else math.nan
    out["busy_host"] = busy_host(out["load_before"], out["load_after"], out["cores_per_node"],
                                 out["ranks_per_node"], out["threads_per_rank"])
    return out


def _work(runs: pd.DataFrame, samples: float) -> float:
    """Work per step; NaN (unknown: strong scaling assumed) unless a finite positive amount,
    so a bad ``problem_size`` or batch in meta.json cannot turn a speedup negative."""
    size = pd.to_numeric(runs["problem_size"], errors="coerce").median()
    work = samples * (size if np.isfinite(size) else 1.0)
    return work if np.isfinite(work) and work > 0 else math.nan


def scaling_table(runs: pd.DataFrame, steps: pd.DataFrame, mode: str | None = None,
                  warmup: int | None = None, strict: bool = False) -> pd.DataFrame:
    """The scaling table: one row per (config, ranks) with ``TABLE_COLUMNS``.

    Args:
        runs: One row per run (from [load][hpcpar.analysis.load.load]).
        steps: The step records, warm-up steps still in (from ``load``); they are dropped
            here with ``warmup`` (see ``stats.drop_warmup``).
        mode: ``"strong"`` or ``"weak"``; detected per config from the runs when None.
        warmup: Steps dropped at the start of every run segment; the runs' own setting,
            else a tenth of the steps (at least one), when None.
        strict: Raise when runs of one config differ in their settings; without it, each
            differing settings hash is a row of its own (see ``settings.split_unlike``).

    Returns:
        Median/std/CV of step time, speedup, efficiency, Karp-Flatt serial fraction,
        throughput, time breakdown and load imbalance per (config, ranks); ``suspect``
        flags a point that beats the cores it used (see ``suspect.superlinear``).

    Raises:
        ConfigError: An unknown ``mode``; ``strict`` and runs with different settings.
    """
    if mode is not None and mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES} or None, got {mode!r}")
    if "settings_hash" in runs:
        runs = split_unlike(runs, strict)
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
    table["suspect"] = superlinear(table, runs)
    return table[list(TABLE_COLUMNS)].reset_index(drop=True)


def _relative(points: dict, mode: str | None) -> list[dict]:
    """Speedup, efficiency, Karp-Flatt and the Amdahl fit of one config's points."""
    usable = [p for p, r in sorted(points.items()) if np.isfinite(r["t_step_median"])]
    if not usable:
        for r in points.values():
            r.update(mode=mode or "unknown", note=r["note"] or "no usable steps")
            r.pop("_work")
            r.pop("_boot")
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
        boot = stats.speedup(r["_boot"], base["_boot"] if p != p0 else r["_boot"], work_ratio)
        lo, hi = stats.percentile_interval(boot)
        r.update(mode=chosen, baseline_ranks=p0, ideal_speedup=q, speedup=S,
                 efficiency=stats.efficiency(S, q), karp_flatt=stats.karp_flatt(S, q),
                 speedup_lo=lo, speedup_hi=hi, efficiency_lo=lo / q, efficiency_hi=hi / q,
                 note="; ".join(notes), partial=r["partial"] or base["partial"])
    qs, Ss = [p / p0 for p in usable], [points[p]["speedup"] for p in usable]
    f = stats.amdahl_fit(qs, Ss)
    law, fit, law_speedup = stats.LAWS.get(chosen, (None, None, None))
    fl = fit(qs, Ss) if fit else math.nan
    r2 = stats.fit_r2(Ss, law_speedup(fl, qs)) \
        if law_speedup is not None and np.isfinite(fl) else math.nan
    why = stats.fit_verdict(qs, Ss, fl, r2) if fit else \
        f"{chosen} scaling: no scaling law to fit"
    for p, r in points.items():
        r["amdahl_serial_fraction"] = f
        r["amdahl_speedup"] = float(stats.amdahl_speedup(f, p / p0)) if np.isfinite(f) else math.nan
        r.update(fit_law=law or "", fit_serial_fraction=fl, fit_r2=r2, fit_shown=not why,
                 fit_note=why)
        r.pop("_work")
        r.pop("_boot")
    return [points[p] for p in sorted(points)]
