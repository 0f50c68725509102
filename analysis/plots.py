"""PNG plots of a scaling table (matplotlib, Agg backend: no display needed).

Each function draws one figure from the table of :func:`hpcpar.analysis.scaling_table` (or,
for the heatmap, one run's steps) and returns the written path.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["PHASE_COLORS", "PHASE_LABELS", "speedup_plot", "efficiency_plot", "throughput_plot",
           "breakdown_plot", "imbalance_heatmap", "step_times_plot", "resources_plot",
           "compare_plot", "predicted_plot"]

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from . import stats  # noqa: E402

PHASE_COLORS = {"compute": "#4c72b0", "halo": "#dd8452", "comm_exposed": "#c44e52",
                "io": "#55a868", "other": "#8c8c8c", "halo_comm": "#e07b39",
                "halo_local": "#f2c094"}
PHASE_LABELS = {"compute": "compute", "halo": "halo exchange", "comm_exposed":
                "exposed allreduce", "io": "I/O wait", "other": "other (untimed)",
                "halo_comm": "halo communication (wait)",
                "halo_local": "halo local copies/padding"}
OVERSUB_LABEL = "oversubscribed (ranks x threads > cores)"


def _save(fig, path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rank_axis(ax, ranks, log=True) -> None:
    ranks = sorted(set(int(r) for r in ranks))
    if log:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ranks)
    ax.set_xticklabels([str(r) for r in ranks])
    ax.minorticks_off()
    ax.set_xlabel("ranks")
    ax.grid(True, which="major", alpha=0.3)


def _mark_partial(ax, x, y, partial) -> None:
    """Hollow red rings around points computed from partial runs."""
    sel = np.asarray(partial, bool)
    if sel.any():
        ax.scatter(np.asarray(x)[sel], np.asarray(y)[sel], s=160, facecolors="none",
                   edgecolors="red", linewidths=1.5, label="partial run", zorder=5)


def _mark_oversubscribed(ax, x, y, flags) -> None:
    """Orange crosses on points whose ranks x threads exceed the cores of a node."""
    sel = np.asarray([_flag(f) for f in flags], bool)
    if sel.any():
        ax.scatter(np.asarray(x, float)[sel], np.asarray(y, float)[sel], s=140, marker="X",
                   color="#ff7f0e", edgecolors="black", linewidths=0.6, label=OVERSUB_LABEL,
                   zorder=6)


def _errorbars(ax, t, column, color) -> None:
    lo, hi = f"{column}_lo", f"{column}_hi"
    if lo not in t or not t[lo].notna().any():
        return
    y = t[column].to_numpy(float)
    err = np.vstack([np.clip(y - t[lo].to_numpy(float), 0, None),
                     np.clip(t[hi].to_numpy(float) - y, 0, None)])
    ax.errorbar(t["ranks"], y, yerr=np.nan_to_num(err), fmt="none", ecolor=color, capsize=4,
                alpha=0.8)


def _dedupe_legend(ax, **kw) -> None:
    handles, labels = ax.get_legend_handles_labels()
    seen: dict = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    ax.legend(list(seen.values()), list(seen), **kw)


def speedup_plot(table: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Log-log speedup vs ranks per config with 95% bootstrap intervals, the ideal line
    S = p/p0, and the fitted law (Amdahl for strong, Gustafson for weak scaling) with its
    R^2 where it is meaningful (else the legend says why it is not drawn).

    Args:
        table: The scaling table.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for config, t in table.groupby("config"):
        line, = ax.plot(t["ranks"], t["speedup"], "o-", label=f"{config} ({t['mode'].iloc[0]})")
        _errorbars(ax, t, "speedup", line.get_color())
        ax.plot(t["ranks"], t["ideal_speedup"], ":", color="black", alpha=0.6)
        r = t.iloc[0]
        f, law = r["fit_serial_fraction"], str(r["fit_law"] or "")
        if r["fit_shown"] and np.isfinite(f) and law:
            p0 = r["baseline_ranks"]
            p = np.geomspace(t["ranks"].min(), t["ranks"].max(), 50)
            ax.plot(p, stats.LAWS[t["mode"].iloc[0]][2](f, p / p0), "--",
                    color=line.get_color(), alpha=0.6,
                    label=f"{law.capitalize()} fit: serial fraction {f:.3f}, "
                          f"R\u00b2 {r['fit_r2']:.3f}")
        elif len(t) > 1 and r["fit_note"]:
            ax.plot([], [], " ", label=f"no {law.capitalize() or 'scaling-law'} fit: "
                                       f"{r['fit_note']}")
        _mark_partial(ax, t["ranks"], t["speedup"], t["partial"])
        if "oversubscribed" in t:
            _mark_oversubscribed(ax, t["ranks"], t["speedup"], t["oversubscribed"])
    ax.plot([], [], ":", color="black", label="ideal")
    ax.set_yscale("log", base=2)
    _rank_axis(ax, table["ranks"])
    ax.set_ylabel("speedup over the baseline (95% bootstrap interval)")
    ax.set_title("Speedup")
    _dedupe_legend(ax, fontsize=7)
    return _save(fig, path)


def _by_ranks(table, column, ylabel, title, path, ideal=None) -> tuple[Path, Axes]:
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for config, t in table.groupby("config"):
        line, = ax.plot(t["ranks"], t[column], "o-", label=str(config))
        _errorbars(ax, t, column, line.get_color())
        if ideal is not None:
            ax.plot(t["ranks"], ideal(t), ":", color="black", alpha=0.6)
        _mark_partial(ax, t["ranks"], t[column], t["partial"])
        if "oversubscribed" in t:
            _mark_oversubscribed(ax, t["ranks"], t[column], t["oversubscribed"])
    if ideal is not None:
        ax.plot([], [], ":", color="black", label="ideal")
    _rank_axis(ax, table["ranks"])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _dedupe_legend(ax, fontsize=8)
    return _save(fig, path), ax


def efficiency_plot(table: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Parallel efficiency vs ranks (1 = perfect scaling).

    Args:
        table: The scaling table.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    modes = "/".join(sorted(set(table["mode"])))
    out, _ = _by_ranks(table, "efficiency", f"efficiency ({modes}; 95% bootstrap interval)",
                       "Parallel efficiency", path, ideal=lambda t: np.ones(len(t)))
    return out


def throughput_plot(table: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Samples per second vs ranks, with linear scaling from the baseline as the ideal.

    Args:
        table: The scaling table.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    def ideal(t):
        base = t[t["ranks"] == t["baseline_ranks"]]["throughput"]
        return base.iloc[0] * t["ideal_speedup"] if len(base) else np.full(len(t), np.nan)

    out, _ = _by_ranks(table, "throughput", "samples / s", "Throughput", path, ideal=ideal)
    return out


def _maybe_log(ax, values) -> None:
    """Log y axis when the values span more than 8x (else linear: readable ticks)."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v) & (v > 0)]
    if len(v) and v.max() > 8 * v.min():
        ax.set_yscale("log")


def _flag(value) -> bool:
    """True for a recorded True (None / NaN: unknown, False)."""
    return value is not None and value == value and bool(value)


def _point_labels(table) -> list[str]:
    labels = []
    for c, p, o in zip(table["config"], table["ranks"],
                       table.get("oversubscribed", [None] * len(table))):
        text = f"{textwrap.fill(str(c), 14)}\n{p}" if table["config"].nunique() > 1 else str(p)
        labels.append(text + ("\noversub." if _flag(o) else ""))
    return labels


def breakdown_plot(table: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Stacked bars: mean seconds per step of each phase (rank average), per config and p.

    The halo exchange is split into communication (waiting for messages) and local copies /
    padding; where the records do not split it, the whole halo is one hatched bar labelled
    so. Unmeasured phases are named above their bar (their time is in "other"); the labels
    of oversubscribed points say so.

    Args:
        table: The scaling table.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    x = np.arange(len(table))
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(table) + 4.5), 4.8))
    bottom = np.zeros(len(table))
    split = table["t_halo_comm"].notna().to_numpy() if "t_halo_comm" in table else \
        np.zeros(len(table), bool)
    for phase in stats.BREAKDOWN_PHASES:
        if phase == "halo_comm" and (~split).any():  # unsplit halo: one hatched bar
            h = np.where(split, 0.0, table["t_halo"].fillna(0).clip(lower=0).to_numpy())
            ax.bar(x, h, bottom=bottom, color=PHASE_COLORS["halo"], hatch="//",
                   edgecolor="white", label="halo (comm/local split not recorded)")
            bottom += h
        col = f"t_{phase}"
        if col not in table:
            continue
        h = table[col].fillna(0).clip(lower=0).to_numpy()
        label = PHASE_LABELS[phase]
        if phase == "other" and any(set(str(u or "").split(",")) - {"", "halo_comm",
                                                                       "halo_local"}
                                    for u in table.get("unmeasured", [])):
            label = "other (untimed + unmeasured phases)"
        if h.any():
            ax.bar(x, h, bottom=bottom, color=PHASE_COLORS[phase], label=label)
        bottom += h
    for xi, r in zip(x, table.to_dict("records")):
        marks = ["partial"] if r["partial"] else []
        missing = [m for m in str(r.get("unmeasured") or "").split(",")
                   if m and m not in ("halo_comm", "halo_local")]
        if missing:
            marks.append("unmeasured: " + ", ".join(PHASE_LABELS.get(m, m) for m in missing))
        if marks:
            ax.annotate("\n".join(marks), (xi, bottom[xi]), ha="center", va="bottom",
                        color="red", fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels(_point_labels(table))
    for tick, o in zip(ax.get_xticklabels(), table.get("oversubscribed", [None] * len(x))):
        if _flag(o):
            tick.set_color("#d35400")
    ax.set_xlabel("ranks")
    ax.set_ylabel("seconds per step (mean over ranks)")
    ax.set_title("Time breakdown")
    ax.set_ylim(top=max(bottom.max(), 1e-12) * 1.18)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def step_times_plot(table: pd.DataFrame, steps: pd.DataFrame, runs: pd.DataFrame,
                    path: str | os.PathLike) -> Path:
    """Spread: one box per (config, p) of the step times T_s of every kept step (whiskers
    1.5 IQR, outliers as dots), and each run's median as a black diamond (run-to-run spread).

    Args:
        table: The scaling table (which points, in which order).
        steps: The kept step records (warm-up dropped).
        runs: The run table (config of each run, after the like-for-like split).
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    T = stats.step_time(steps) if len(steps) else pd.Series(dtype=float)
    data, medians = [], []
    for c, p in zip(table["config"], table["ranks"]):
        mine = [r for r in runs[(runs["config"] == c) & (runs["ranks"] == p)]["run"]]
        sel = T[T.index.get_level_values("run").isin(mine)] if len(T) else T
        data.append(sel.to_numpy(float))
        medians.append(sel.groupby(level="run").median().to_numpy(float) if len(sel) else [])
    x = np.arange(len(table))
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(table) + 3.5), 4.8))
    ok = [i for i, d in enumerate(data) if len(d)]
    if ok:
        ax.boxplot([data[i] for i in ok], positions=x[ok], widths=0.5, showfliers=True,
                   flierprops={"markersize": 3, "alpha": 0.5})
    for i, m in enumerate(medians):
        if len(m):
            ax.scatter(np.full(len(m), x[i]) + np.linspace(-0.12, 0.12, len(m)) * (len(m) > 1),
                       m, marker="D", s=22, color="black", zorder=5,
                       label="median of one run")
    over = table.get("oversubscribed", pd.Series([None] * len(x))).to_numpy()
    for i in range(len(x)):  # x is arange: its values are the indices
        if _flag(over[i]) and len(data[i]):
            ax.annotate("oversubscribed", (x[i], np.nanmax(data[i])), ha="center",
                        va="bottom", color="#d35400", fontsize=7)
    _maybe_log(ax, np.concatenate([d for d in data if len(d)] or [np.ones(1)]))
    ax.set_xticks(x)
    ax.set_xticklabels(_point_labels(table))
    for tick, o in zip(ax.get_xticklabels(), over):
        if _flag(o):
            tick.set_color("#d35400")
    ax.set_xlabel("ranks")
    ax.set_ylabel("step time T_s (s, max over ranks)")
    ax.set_title("Step-time spread (box: steps; diamonds: run medians)")
    ax.grid(True, axis="y", alpha=0.3)
    if medians and any(len(m) for m in medians):
        _dedupe_legend(ax, fontsize=8)
    return _save(fig, path)


def resources_plot(table: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Bytes moved per step (halo, allreduce, read; sum over ranks, median over steps) and
    peak memory of the largest rank, vs ranks.

    Args:
        table: The scaling table.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    styles = {"bytes_halo_per_step": ("halo", "o-"), "bytes_allreduce_per_step":
              ("allreduce", "s--"), "bytes_read_per_step": ("read", "^:")}
    many = table["config"].nunique() > 1
    for config, t in table.groupby("config"):
        for col, (name, style) in styles.items():
            y = t[col].to_numpy(float)
            if np.isfinite(y).any():
                ax1.plot(t["ranks"], np.where(y > 0, y, np.nan), style,
                         label=f"{config}: {name}" if many else name)
        ax2.plot(t["ranks"], t["peak_mem_max"] / 2**20, "o-", label=str(config))
        if "oversubscribed" in t:
            _mark_oversubscribed(ax2, t["ranks"], t["peak_mem_max"] / 2**20,
                                 t["oversubscribed"])
    ax1.set_yscale("log")
    ax1.set_ylabel("bytes per step (all ranks; 0 not drawn)")
    ax1.set_title("Bytes moved per step")
    ax2.set_ylabel("MiB")
    ax2.set_title("Peak memory of the largest rank")
    return _finish_pair(fig, (ax1, ax2), table["ranks"], path)


def _ratio_line(ax, ranks, ratio, label, color=None) -> None:
    """A ratio per point, each labelled with its value, and the line at 1."""
    ax.plot(ranks, ratio, "o-", color=color, label=label)
    for p, r in zip(ranks, ratio):
        if np.isfinite(r):
            ax.annotate(f"{r:.2f}", (p, r), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)
    ax.axhline(1.0, color="black", ls=":", alpha=0.6)


def _finish_pair(fig, axes, ranks, path) -> Path:
    for ax in axes:
        _rank_axis(ax, ranks)
        if ax.get_legend_handles_labels()[0]:
            _dedupe_legend(ax, fontsize=8)
    return _save(fig, path)


def compare_plot(cmp: pd.DataFrame, labels: tuple, path: str | os.PathLike) -> Path:
    """Before/after: median step time of both sweeps vs ranks (left, with the run-to-run
    range) and the ratio after/before per point (right; below 1 = faster).

    Args:
        cmp: The comparison table (``compare_tables``).
        labels: Names of the two sweeps (before, after).
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for config, t in cmp.groupby("config"):
        for side, style, lab in (("a", "o-", labels[0]), ("b", "s--", labels[1])):
            y = t[f"t_step_median_{side}"].to_numpy(float)
            err = np.vstack([y - t[f"t_step_run_min_{side}"], t[f"t_step_run_max_{side}"] - y])
            ax1.errorbar(t["ranks"], y, yerr=np.nan_to_num(np.clip(err, 0, None)), fmt=style,
                         capsize=3, label=f"{config}: {lab}")
        _ratio_line(ax2, t["ranks"], t["ratio"], str(config))
        _mark_oversubscribed(ax2, t["ranks"], t["ratio"],
                             [_flag(a) or _flag(b) for a, b in zip(t["oversubscribed_a"],
                                                                   t["oversubscribed_b"])])
    _maybe_log(ax1, cmp[["t_step_median_a", "t_step_median_b"]].to_numpy(float).ravel())
    ax1.set_ylabel("median step time (s); bars: run-to-run range")
    ax1.set_title("Step time")
    ax2.set_ylabel(f"step time ratio {labels[1]} / {labels[0]}")
    ax2.set_title("Ratio per point (< 1: faster)")
    return _finish_pair(fig, (ax1, ax2), cmp["ranks"], path)


def imbalance_heatmap(steps: pd.DataFrame, title: str, path: str | os.PathLike) -> Path:
    """Rank x phase heatmap of one run.

    Colour = seconds per step relative to the mean over ranks of that phase (1 = average;
    the slowest rank stands out), text = seconds.

    Args:
        steps: The step records of one run.
        title: The plot's title.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    table = stats.rank_phase_table(steps)
    phases = list(stats.BREAKDOWN_PHASES) if table["halo_comm"].notna().any() else \
        ["compute", "halo", "comm_exposed", "io", "other"]
    table = table[phases]
    means = table.mean(axis=0)
    # phases under 1% of the step are left grey: their ratios are noise, not imbalance
    rel = table / means.where(means > 0.01 * means.clip(lower=0).sum())
    fig, ax = plt.subplots(figsize=(8, 2.6 + 0.3 * min(len(table), 64)))
    dev = np.nanmax(np.abs(rel.to_numpy() - 1)) if rel.notna().any().any() else 0.1
    dev = max(float(dev), 0.05)
    cmap = matplotlib.colormaps["coolwarm"].with_extremes(bad="#e0e0e0")
    im = ax.imshow(rel.to_numpy(float), aspect="auto", cmap=cmap, vmin=1 - dev,
                   vmax=1 + dev, interpolation="nearest")
    ax.set_xticks(range(len(phases)))
    ax.set_xticklabels([PHASE_LABELS[p] for p in phases], rotation=20, ha="right", fontsize=8)
    ax.set_yticks(range(len(table)))
    ax.set_yticklabels([str(r) for r in table.index])
    ax.set_ylabel("rank")
    if len(table) <= 32:
        for (i, j), v in np.ndenumerate(table.to_numpy(float)):
            ax.text(j, i, f"{v * 1e3:.3g} ms", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="ratio to the mean over ranks")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def predicted_plot(pred: pd.DataFrame, title: str, path: str | os.PathLike) -> Path:
    """Measured vs predicted step time per config (left; phases as thin lines) and the
    ratio measured / predicted per point (right; 1 = the model is right).

    Args:
        pred: The table of ``predicted_vs_measured``.
        title: What made the prediction (``"hpcpar plan, machine local"``).
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for config, t in pred.groupby("config"):
        line, = ax1.plot(t["ranks"], t["t_step_measured"], "o-", label=f"{config}: measured")
        ax1.plot(t["ranks"], t["t_step_predicted"], "s--", color=line.get_color(),
                 label=f"{config}: predicted")
        _ratio_line(ax2, t["ranks"], t["ratio"], str(config), line.get_color())
    _maybe_log(ax1, pred[["t_step_measured", "t_step_predicted"]].to_numpy(float).ravel())
    ax1.set_ylabel("seconds per step")
    ax1.set_title(f"Step time: measured vs {title}")
    ax2.set_ylabel("measured / predicted")
    ax2.set_title("Ratio per point (1: the model is right)")
    return _finish_pair(fig, (ax1, ax2), pred["ranks"], path)
