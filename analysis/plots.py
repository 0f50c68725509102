"""PNG plots of a scaling table (matplotlib, Agg backend: no display needed).

Each function draws one figure from the table of :func:`hpcpar.analysis.scaling_table` (or,
for the heatmap, one run's steps) and returns the written path.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from . import stats  # noqa: E402

PHASE_COLORS = {"compute": "#4c72b0", "halo": "#dd8452", "comm_exposed": "#c44e52",
                "io": "#55a868", "other": "#8c8c8c"}
PHASE_LABELS = {"compute": "compute", "halo": "halo exchange", "comm_exposed":
                "exposed allreduce", "io": "I/O wait", "other": "other"}


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


def speedup_plot(table: pd.DataFrame, path) -> Path:
    """Log-log speedup vs ranks per config, the ideal line S = p/p0, and the Amdahl fit."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for config, t in table.groupby("config"):
        line, = ax.plot(t["ranks"], t["speedup"], "o-", label=f"{config} ({t['mode'].iloc[0]})")
        ax.plot(t["ranks"], t["ideal_speedup"], ":", color="black", alpha=0.6)
        f = t["amdahl_serial_fraction"].iloc[0]
        if np.isfinite(f) and len(t) > 1:
            p0 = t["baseline_ranks"].iloc[0]
            p = np.geomspace(t["ranks"].min(), t["ranks"].max(), 50)
            ax.plot(p, stats.amdahl_speedup(f, p / p0), "--", color=line.get_color(),
                    alpha=0.6, label=f"Amdahl fit, serial fraction {f:.3f}")
        _mark_partial(ax, t["ranks"], t["speedup"], t["partial"])
    ax.plot([], [], ":", color="black", label="ideal")
    ax.set_yscale("log", base=2)
    _rank_axis(ax, table["ranks"])
    ax.set_ylabel("speedup over the baseline")
    ax.set_title("Speedup")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _by_ranks(table, column, ylabel, title, path, ideal=None) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for config, t in table.groupby("config"):
        ax.plot(t["ranks"], t[column], "o-", label=str(config))
        if ideal is not None:
            ax.plot(t["ranks"], ideal(t), ":", color="black", alpha=0.6)
        _mark_partial(ax, t["ranks"], t[column], t["partial"])
    if ideal is not None:
        ax.plot([], [], ":", color="black", label="ideal")
    _rank_axis(ax, table["ranks"])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path), ax


def efficiency_plot(table: pd.DataFrame, path) -> Path:
    """Parallel efficiency vs ranks (1 = perfect scaling)."""
    modes = "/".join(sorted(set(table["mode"])))
    out, _ = _by_ranks(table, "efficiency", f"efficiency ({modes})", "Parallel efficiency",
                       path, ideal=lambda t: np.ones(len(t)))
    return out


def throughput_plot(table: pd.DataFrame, path) -> Path:
    """Samples per second vs ranks, with linear scaling from the baseline as the ideal."""
    def ideal(t):
        base = t[t["ranks"] == t["baseline_ranks"]]["throughput"]
        return base.iloc[0] * t["ideal_speedup"] if len(base) else np.full(len(t), np.nan)

    out, _ = _by_ranks(table, "throughput", "samples / s", "Throughput", path, ideal=ideal)
    return out


def breakdown_plot(table: pd.DataFrame, path) -> Path:
    """Stacked bars: mean seconds per step of each phase (rank average), per config and p."""
    labels = [f"{c}\n{p}" if table["config"].nunique() > 1 else str(p)
              for c, p in zip(table["config"], table["ranks"])]
    x = np.arange(len(table))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(table) + 3.5), 4.5))
    bottom = np.zeros(len(table))
    for phase in stats.PHASES:
        h = table[f"t_{phase}"].fillna(0).clip(lower=0).to_numpy()
        ax.bar(x, h, bottom=bottom, color=PHASE_COLORS[phase], label=PHASE_LABELS[phase])
        bottom += h
    for xi, partial in zip(x, table["partial"]):
        if partial:
            ax.annotate("partial", (xi, bottom[xi]), ha="center", va="bottom", color="red",
                        fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_xlabel("ranks")
    ax.set_ylabel("seconds per step (mean over ranks)")
    ax.set_title("Time breakdown")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def imbalance_heatmap(steps: pd.DataFrame, title: str, path) -> Path:
    """Rank x phase heatmap of one run: colour = seconds per step relative to the mean over
    ranks of that phase (1 = average; the slowest rank stands out), text = seconds."""
    table = stats.rank_phase_table(steps)[list(stats.PHASES)]
    means = table.mean(axis=0)
    # phases under 1% of the step are left grey: their ratios are noise, not imbalance
    rel = table / means.where(means > 0.01 * means.clip(lower=0).sum())
    fig, ax = plt.subplots(figsize=(7, 2.2 + 0.3 * min(len(table), 64)))
    dev = np.nanmax(np.abs(rel.to_numpy() - 1)) if rel.notna().any().any() else 0.1
    dev = max(float(dev), 0.05)
    cmap = matplotlib.colormaps["coolwarm"].with_extremes(bad="#e0e0e0")
    im = ax.imshow(rel.to_numpy(float), aspect="auto", cmap=cmap, vmin=1 - dev,
                   vmax=1 + dev, interpolation="nearest")
    ax.set_xticks(range(len(stats.PHASES)))
    ax.set_xticklabels([PHASE_LABELS[p] for p in stats.PHASES], rotation=20)
    ax.set_yticks(range(len(table)))
    ax.set_yticklabels([str(r) for r in table.index])
    ax.set_ylabel("rank")
    if len(table) <= 32:
        for (i, j), v in np.ndenumerate(table.to_numpy(float)):
            ax.text(j, i, f"{v * 1e3:.3g} ms", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="ratio to the mean over ranks")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)
