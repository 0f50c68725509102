"""Scaling statistics, one per function, each with its formula.

Notation: r a rank, s a step, p the number of ranks, p0 the smallest rank count of a config
(the baseline), q = p / p0. ``t[r, s]`` is column ``t_step`` of rank r at step s.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

__all__ = ["PHASES", "warmup_steps", "drop_warmup", "step_time", "global_samples", "median",
           "mean", "std", "cv", "throughput", "speedup", "efficiency", "karp_flatt", "amdahl_fit",
           "amdahl_speedup", "gustafson_fit", "gustafson_speedup", "LAWS", "fit_r2",
           "fit_verdict", "bootstrap_medians",
           "phase_times", "fractions", "phase_per_step", "rank_phase_table", "imbalance",
           "percentile_interval", "unmeasured", "TOTALS", "BREAKDOWN_PHASES"]

#: Phases of the time breakdown, derived per row by :func:`phase_times`. ``halo`` is the
#: whole halo exchange, split into ``halo_comm`` (waiting for messages) and ``halo_local``
#: (packing, padding, buffer fills); the disjoint phases are ``BREAKDOWN_PHASES``.
PHASES = ("compute", "halo", "comm_exposed", "io", "other", "halo_comm", "halo_local")
#: Phases that add up to t_step (halo split).
BREAKDOWN_PHASES = ("compute", "halo_comm", "halo_local", "comm_exposed", "io", "other")
#: Phases that are sums of others.
TOTALS = {"halo": ("halo_comm", "halo_local")}
#: The record column each measured phase needs (NaN there: the phase is unmeasured).
_SOURCE = {"compute": "t_fwd", "halo": "t_halo", "halo_comm": "t_halo_wait",
           "halo_local": "t_halo_wait", "comm_exposed": "t_allreduce_exposed",
           "io": "t_data"}


def warmup_steps(n_steps: int, requested: float | None = None) -> int:
    """Steps dropped at the start of each run segment: w = max(1, floor(n_steps / 10)).

    Args:
        n_steps: Steps the run recorded.
        requested: ``--warmup``, else the run's ``timing_warmup`` meta; used when not None
            or NaN.

    Returns:
        w.
    """
    if requested is not None and not (isinstance(requested, float) and math.isnan(requested)):
        return int(requested)
    return max(1, n_steps // 10)


def drop_warmup(steps: pd.DataFrame, runs: pd.DataFrame,
                warmup: int | None = None) -> pd.DataFrame:
    """Drop the first w steps of every segment (the start and each resume).

    The first steps pay for allocation, caches and JIT.

    Args:
        steps: The step records (from ``hpcpar.analysis.load``).
        runs: The run table (segment starts and ``timing_warmup`` per run).
        warmup: w for every run; ``warmup_steps`` per run when None.

    Returns:
        The remaining steps.
    """
    keep = []
    for run, group in steps.groupby("run", sort=False):
        facts = runs.set_index("run").loc[run]
        step_ids = np.sort(group["step"].unique())
        w = warmup_steps(len(step_ids), warmup if warmup is not None else facts["timing_warmup"])
        starts = list(facts["segment_starts"] or []) or [int(step_ids[0])]
        drop = np.zeros(len(group), dtype=bool)
        for first in starts:
            drop |= (group["step"].to_numpy() >= first) & (group["step"].to_numpy() < first + w)
        if starts[0] > step_ids[0]:  # rows before the recorded first segment: also warm-up
            drop |= group["step"].to_numpy() < step_ids[0] + w
        keep.append(group[~drop])
    return pd.concat(keep) if keep else steps.iloc[0:0]


def step_time(steps: pd.DataFrame) -> pd.Series:
    """Step time of each (run, step): T_s = max_r t[r, s] (the slowest rank sets the pace).

    Args:
        steps: The step records.

    Returns:
        T indexed by (run, step).
    """
    return steps.groupby(["run", "step"])["t_step"].max()


def global_samples(steps: pd.DataFrame, spatial_size: pd.Series) -> pd.Series:
    """Samples of each (run, step) over all ranks: N_s = sum_r samples[r, s] / (X*Y*Z).

    The X*Y*Z ranks of one spatial group share (and each report) the same samples.

    Args:
        steps: The step records.
        spatial_size: X*Y*Z of each run, indexed by run.

    Returns:
        N indexed by (run, step).
    """
    summed = steps.groupby(["run", "step"])["samples"].sum(min_count=1)
    return summed / spatial_size.reindex(summed.index.get_level_values("run")).to_numpy()


def median(T: pd.Series) -> float:
    """median_s T_s (NaN when empty).

    Args:
        T: Step times.

    Returns:
        The median.
    """
    return float(T.median()) if len(T) else math.nan


def mean(T: pd.Series) -> float:
    """(1/n) sum_s T_s (NaN when empty).

    Args:
        T: Step times.

    Returns:
        The mean.
    """
    return float(T.mean()) if len(T) else math.nan


def std(T: pd.Series) -> float:
    """Sample standard deviation sqrt(sum_s (T_s - mean)^2 / (n - 1)).

    Args:
        T: Step times.

    Returns:
        The standard deviation; NaN for n < 2.
    """
    return float(T.std(ddof=1)) if len(T) > 1 else math.nan


def cv(T: pd.Series) -> float:
    """Coefficient of variation std(T) / mean(T).

    Args:
        T: Step times.

    Returns:
        The CV; NaN for n < 2.
    """
    return std(T) / mean(T) if len(T) > 1 else math.nan


def throughput(N: pd.Series, T: pd.Series) -> float:
    """Samples per second: median_s (N_s / T_s).

    Args:
        N: Samples per step (``global_samples``).
        T: Step times (``step_time``).

    Returns:
        The throughput; NaN when empty.
    """
    return float((N / T).median()) if len(T) else math.nan


def speedup(T: float, T0: float, work_ratio: float = 1.0) -> float:
    """Speedup over the baseline: S = (W / T) / (W0 / T0) = work_ratio * T0 / T.

    W is the work per step (global batch x problem size). Strong scaling (W = W0):
    S = T0 / T; weak scaling (W = q W0): S = q T0 / T (scaled speedup).

    Args:
        T: Step time at p ranks.
        T0: Step time of the baseline (p0 ranks).
        work_ratio: W / W0.

    Returns:
        S.
    """
    return work_ratio * T0 / T


def efficiency(S: float, q: float) -> float:
    """Parallel efficiency E = S / q. Strong: p0 T(p0) / (p T(p)); weak: T(p0) / T(p).

    Args:
        S: Speedup.
        q: p / p0.

    Returns:
        E.
    """
    return S / q


def karp_flatt(S: float, q: float) -> float:
    """Experimentally determined serial fraction e = (1/S - 1/q) / (1 - 1/q).

    Relative to the baseline (q = p with a 1-rank baseline: the textbook form).

    Args:
        S: Speedup.
        q: p / p0.

    Returns:
        e; NaN at q = 1.
    """
    return (1.0 / S - 1.0 / q) / (1.0 - 1.0 / q) if q != 1 else math.nan


def amdahl_fit(q: ArrayLike, S: ArrayLike) -> float:
    """Amdahl serial fraction f fitted to speedups: S(q) = 1 / (f + (1 - f) / q).

    Equivalently 1/S - 1/q = f (1 - 1/q); least squares f = sum x y / sum x^2 with
    x = 1 - 1/q, y = 1/S - 1/q over the points q > 1.

    Args:
        q: p / p0 of each point.
        S: Speedup of each point.

    Returns:
        f; NaN without a point with q > 1.
    """
    q, S = np.asarray(q, float), np.asarray(S, float)
    ok = (q > 1) & np.isfinite(S) & (S > 0)
    if not ok.any():
        return math.nan
    x, y = 1 - 1 / q[ok], 1 / S[ok] - 1 / q[ok]
    return float(np.linalg.lstsq(x[:, None], y, rcond=None)[0][0])


def amdahl_speedup(f: float, q: ArrayLike) -> np.ndarray:
    """Speedup predicted by the fit: S(q) = 1 / (f + (1 - f) / q).

    Args:
        f: Serial fraction (``amdahl_fit``).
        q: p / p0.

    Returns:
        S(q).
    """
    q = np.asarray(q, float)
    return 1.0 / (f + (1.0 - f) / q)


def phase_times(steps: pd.DataFrame) -> pd.DataFrame:
    """The time breakdown of every row.

    io = t_data; halo = t_halo = halo_comm + halo_local with halo_comm = t_halo_wait
    (waiting for messages; 0 on one rank) and halo_local = t_halo - t_halo_wait (copies,
    padding, packing); comm_exposed = t_allreduce_exposed; compute = t_fwd + t_bwd + t_opt -
    t_halo; other = t_step - (compute + halo + comm_exposed + io) over the MEASURED phases
    (loop overhead and anything not timed). A phase whose record column is empty is NaN
    (unmeasured: see :func:`unmeasured`), never folded into another phase; the time it
    took stays in ``other``, which the report then labels as holding it.

    Args:
        steps: The step records.

    Returns:
        One column per phase (``PHASES``), same index as ``steps``.
    """
    out = pd.DataFrame(index=steps.index)
    out["compute"] = steps["t_fwd"] + steps["t_bwd"] + steps["t_opt"] - steps["t_halo"]
    out["halo"] = steps["t_halo"]
    out["comm_exposed"] = steps["t_allreduce_exposed"]
    out["io"] = steps["t_data"]
    out["other"] = steps["t_step"] - out[["compute", "halo", "comm_exposed", "io"]].sum(
        axis=1, min_count=1)
    wait = steps["t_halo_wait"] if "t_halo_wait" in steps else np.nan
    out["halo_comm"] = wait
    out["halo_local"] = steps["t_halo"] - wait
    return out


def unmeasured(steps: pd.DataFrame) -> list[str]:
    """Phases with no measurement in any row (their record column is empty everywhere).

    Args:
        steps: The step records.

    Returns:
        The phases, in ``PHASES`` order.
    """
    return [p for p, c in _SOURCE.items()
            if len(steps) and (c not in steps or steps[c].isna().all())]


def fractions(steps: pd.DataFrame) -> dict:
    """Share of rank time per phase: f_X = sum_{r,s} X[r,s] / sum_{r,s} t[r,s].

    Args:
        steps: The step records.

    Returns:
        ``{"frac_compute": ..., "frac_halo": ..., ...}``.
    """
    phases = phase_times(steps)
    total = steps["t_step"].sum()
    return {f"frac_{k}": float(phases[k].sum(min_count=1) / total) if total else math.nan
            for k in PHASES}


def phase_per_step(steps: pd.DataFrame) -> dict:
    """Mean seconds per step of each phase over ranks and steps: (1/(R n)) sum_{r,s} X[r,s].

    Args:
        steps: The step records.

    Returns:
        Phase -> seconds.
    """
    phases = phase_times(steps)
    return {k: float(phases[k].mean()) if len(phases) else math.nan for k in PHASES}


def rank_phase_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Mean seconds per step of each phase for each rank.

    Args:
        steps: The step records.

    Returns:
        Rows: rank; columns: ``PHASES``.
    """
    return phase_times(steps).groupby(steps["rank"]).mean()


def imbalance(steps: pd.DataFrame) -> float:
    """Load imbalance max_r C_r / mean_r C_r, C_r = sum_s compute[r, s].

    Waiting time is excluded so the slowest rank's lead shows.

    Args:
        steps: The step records.

    Returns:
        The imbalance (1 = balanced); NaN when empty.
    """
    C = phase_times(steps)["compute"].groupby(steps["rank"]).sum(min_count=1)
    return float(C.max() / C.mean()) if len(C) and C.mean() else math.nan


def gustafson_fit(q: ArrayLike, S: ArrayLike) -> float:
    """Gustafson serial fraction f fitted to scaled (weak) speedups: S(q) = q - f (q - 1).

    Least squares f = sum (q - S)(q - 1) / sum (q - 1)^2 over the points q > 1.

    Args:
        q: p / p0 of each point.
        S: Scaled speedup of each point.

    Returns:
        f; NaN without a point with q > 1.
    """
    q, S = np.asarray(q, float), np.asarray(S, float)
    ok = (q > 1) & np.isfinite(S)
    if not ok.any():
        return math.nan
    x = q[ok] - 1
    return float(((q[ok] - S[ok]) * x).sum() / (x * x).sum())


def gustafson_speedup(f: float, q: ArrayLike) -> np.ndarray:
    """Scaled speedup predicted by the fit: S(q) = q - f (q - 1).

    Args:
        f: Serial fraction (``gustafson_fit``).
        q: p / p0.

    Returns:
        S(q).
    """
    q = np.asarray(q, float)
    return q - f * (q - 1)


#: The law fitted per scaling mode: name, fit, prediction.
LAWS = {"strong": ("amdahl", amdahl_fit, amdahl_speedup),
        "weak": ("gustafson", gustafson_fit, gustafson_speedup)}


def fit_r2(S: ArrayLike, S_fit: ArrayLike) -> float:
    """Quality of a fit: R^2 = 1 - sum (S - S_fit)^2 / sum (S - mean S)^2 over all points
    (the baseline q = 1 included).

    Args:
        S: Measured speedup of each point.
        S_fit: The fitted law's speedup at the same points.

    Returns:
        R^2 (1 = perfect; NaN with fewer than 3 points or no spread in S).
    """
    s, s_fit = np.asarray(S, float), np.asarray(S_fit, float)
    ok = np.isfinite(s) & np.isfinite(s_fit)
    s, s_fit = s[ok], s_fit[ok]
    if len(s) < 3:
        return math.nan
    ss_tot = float(((s - s.mean()) ** 2).sum())
    if ss_tot == 0:
        return math.nan
    return 1.0 - float(((s - s_fit) ** 2).sum()) / ss_tot


def fit_verdict(q: ArrayLike, S: ArrayLike, f: float, r2: float, min_r2: float = 0.9) -> str:
    """Why a fitted law (Amdahl, Gustafson) is not drawn, or ``""`` when it is meaningful:
    at least three points (two beyond the baseline), speedups that do not fall as p grows,
    0 <= f <= 1, and R^2 >= ``min_r2``.

    Args:
        q: p / p0 of each point.
        S: Speedup of each point.
        f: The fitted serial fraction.
        r2: Its ``fit_r2``.
        min_r2: The least R^2 worth drawing.

    Returns:
        ``""`` or the reason (one phrase).
    """
    s = np.asarray(S, float)[np.argsort(np.asarray(q, float))]
    s = s[np.isfinite(s)]
    if len(s) < 3:
        return "fewer than 3 rank counts"
    if np.any(np.diff(s) < 0):
        return "speedup falls as ranks grow (non-monotonic)"
    if not (0 <= f <= 1):
        return f"fitted serial fraction {f:.3g} outside [0, 1]"
    if not (r2 >= min_r2):
        return f"poor fit (R^2 = {r2:.2f} < {min_r2})"
    return ""


def bootstrap_medians(samples: dict, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """Bootstrap replicates of a point's median step time, over runs and over steps.

    Each replicate draws the point's runs with replacement, then, within each drawn run,
    its step times T_s with replacement, and takes the median of everything drawn. A
    statistic of medians (speedup, efficiency) gets its interval from the 2.5 and 97.5
    percentiles of the statistic over the replicates (:func:`percentile_interval`).

    Args:
        samples: Run -> array of its step times T_s.
        n_boot: Replicates.
        seed: Seed of the generator (reports are reproducible).

    Returns:
        ``n_boot`` medians (NaN-filled when there are no steps).
    """
    runs = [np.asarray(v, float) for v in samples.values() if len(v)]
    if not runs:
        return np.full(n_boot, np.nan)
    rng = np.random.default_rng(seed)
    out = np.empty(n_boot)
    for b in range(n_boot):
        picked = rng.integers(0, len(runs), len(runs))
        drawn = [runs[i][rng.integers(0, len(runs[i]), len(runs[i]))] for i in picked]
        out[b] = np.median(np.concatenate(drawn))
    return out


def percentile_interval(values: ArrayLike, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` interval of bootstrap replicates: (2.5th, 97.5th) percentile.

    Args:
        values: Replicates of a statistic.
        level: Coverage.

    Returns:
        (low, high); NaNs when there are no finite replicates.
    """
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if not len(v):
        return math.nan, math.nan
    a = (1 - level) / 2 * 100
    return float(np.percentile(v, a)), float(np.percentile(v, 100 - a))
