"""Scaling statistics, one per function, each with its formula.

Notation: r a rank, s a step, p the number of ranks, p0 the smallest rank count of a config
(the baseline), q = p / p0. ``t[r, s]`` is column ``t_step`` of rank r at step s.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

#: Phases of the time breakdown, derived per row by :func:`phase_times`.
PHASES = ("compute", "halo", "comm_exposed", "io", "other")


def warmup_steps(n_steps: int, requested=None) -> int:
    """Steps dropped at the start of each run segment: ``requested`` (``--warmup``, else the
    run's ``timing_warmup`` meta), else w = max(1, floor(n_steps / 10))."""
    if requested is not None and not (isinstance(requested, float) and math.isnan(requested)):
        return int(requested)
    return max(1, n_steps // 10)


def drop_warmup(steps: pd.DataFrame, runs: pd.DataFrame, warmup=None) -> pd.DataFrame:
    """Steps without the first w steps of every segment (the start and each resume), where
    w = :func:`warmup_steps` per run: the first steps pay for allocation, caches and JIT."""
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
    """Step time of each (run, step): T_s = max_r t[r, s] (the slowest rank sets the pace)."""
    return steps.groupby(["run", "step"])["t_step"].max()


def global_samples(steps: pd.DataFrame, spatial_size: pd.Series) -> pd.Series:
    """Samples of each (run, step) over all ranks: N_s = sum_r samples[r, s] / (X*Y*Z), since
    the X*Y*Z ranks of one spatial group share (and each report) the same samples."""
    summed = steps.groupby(["run", "step"])["samples"].sum(min_count=1)
    return summed / spatial_size.reindex(summed.index.get_level_values("run")).to_numpy()


def median(T: pd.Series) -> float:
    """median_s T_s."""
    return float(T.median()) if len(T) else math.nan


def mean(T: pd.Series) -> float:
    """(1/n) sum_s T_s."""
    return float(T.mean()) if len(T) else math.nan


def std(T: pd.Series) -> float:
    """Sample standard deviation sqrt(sum_s (T_s - mean)^2 / (n - 1)); NaN for n < 2."""
    return float(T.std(ddof=1)) if len(T) > 1 else math.nan


def cv(T: pd.Series) -> float:
    """Coefficient of variation std(T) / mean(T)."""
    return std(T) / mean(T) if len(T) > 1 else math.nan


def throughput(N: pd.Series, T: pd.Series) -> float:
    """Samples per second: median_s (N_s / T_s)."""
    return float((N / T).median()) if len(T) else math.nan


def speedup(T: float, T0: float, work_ratio: float = 1.0) -> float:
    """Speedup over the baseline: S = (W / T) / (W0 / T0) = work_ratio * T0 / T, with W the
    work per step (global batch x problem size). Strong scaling (W = W0): S = T0 / T; weak
    scaling (W = q W0): S = q T0 / T (scaled speedup)."""
    return work_ratio * T0 / T


def efficiency(S: float, q: float) -> float:
    """Parallel efficiency E = S / q. Strong: p0 T(p0) / (p T(p)); weak: T(p0) / T(p)."""
    return S / q


def karp_flatt(S: float, q: float) -> float:
    """Experimentally determined serial fraction e = (1/S - 1/q) / (1 - 1/q), relative to the
    baseline (q = p with a 1-rank baseline: the textbook form); NaN at q = 1."""
    return (1.0 / S - 1.0 / q) / (1.0 - 1.0 / q) if q != 1 else math.nan


def amdahl_fit(q, S) -> float:
    """Amdahl serial fraction f fitted to speedups: S(q) = 1 / (f + (1 - f) / q), i.e.
    1/S - 1/q = f (1 - 1/q); least squares f = sum x y / sum x^2 with x = 1 - 1/q,
    y = 1/S - 1/q over the points q > 1. NaN with fewer than one such point."""
    q, S = np.asarray(q, float), np.asarray(S, float)
    ok = (q > 1) & np.isfinite(S) & (S > 0)
    if not ok.any():
        return math.nan
    x, y = 1 - 1 / q[ok], 1 / S[ok] - 1 / q[ok]
    return float(np.linalg.lstsq(x[:, None], y, rcond=None)[0][0])


def amdahl_speedup(f: float, q) -> np.ndarray:
    """Speedup predicted by the fit: S(q) = 1 / (f + (1 - f) / q)."""
    q = np.asarray(q, float)
    return 1.0 / (f + (1.0 - f) / q)


def phase_times(steps: pd.DataFrame) -> pd.DataFrame:
    """Per row: io = t_data; halo = t_halo; comm_exposed = t_allreduce_exposed;
    compute = t_fwd + t_bwd + t_opt - t_halo; other = t_step - (compute + halo + comm_exposed
    + io) (loop overhead, logging, anything not timed)."""
    out = pd.DataFrame(index=steps.index)
    out["compute"] = steps["t_fwd"] + steps["t_bwd"] + steps["t_opt"] - steps["t_halo"]
    out["halo"] = steps["t_halo"]
    out["comm_exposed"] = steps["t_allreduce_exposed"]
    out["io"] = steps["t_data"]
    out["other"] = steps["t_step"] - out[["compute", "halo", "comm_exposed", "io"]].sum(
        axis=1, min_count=4)
    return out


def fractions(steps: pd.DataFrame) -> dict:
    """Share of rank time per phase: f_X = sum_{r,s} X[r,s] / sum_{r,s} t[r,s]."""
    phases = phase_times(steps)
    total = steps["t_step"].sum()
    return {f"frac_{k}": float(phases[k].sum(min_count=1) / total) if total else math.nan
            for k in PHASES}


def phase_per_step(steps: pd.DataFrame) -> dict:
    """Mean seconds per step of each phase over ranks and steps: (1/(R n)) sum_{r,s} X[r,s]."""
    phases = phase_times(steps)
    return {k: float(phases[k].mean()) if len(phases) else math.nan for k in PHASES}


def rank_phase_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Mean seconds per step of each phase for each rank (rows: rank, columns: PHASES)."""
    return phase_times(steps).groupby(steps["rank"]).mean()


def imbalance(steps: pd.DataFrame) -> float:
    """Load imbalance max_r C_r / mean_r C_r, C_r = sum_s compute[r, s] (1 = balanced;
    waiting time is excluded so the slowest rank's lead shows)."""
    C = phase_times(steps)["compute"].groupby(steps["rank"]).sum(min_count=1)
    return float(C.max() / C.mean()) if len(C) and C.mean() else math.nan
