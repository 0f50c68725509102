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

__all__ = ["PHASE_COLORS", "PHASE_LABELS", "FIGSIZE", "speedup_plot", "efficiency_plot",
           "throughput_plot", "breakdown_plot", "imbalance_heatmap", "step_times_plot",
           "bytes_plot", "memory_plot", "compare_plot", "compare_ratio_plot", "predicted_plot",
           "predicted_ratio_plot", "loss_curves_plot"]

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from hpcpar._units import bytes_unit, format_bytes  # noqa: E402

from . import stats  # noqa: E402

#: One panel per figure, at a size whose text reads at 100% on a page and two of which fit
#: side by side in a 1400 px window (inches at 110 dpi: 660 x 462 px); a figure with more
#: points grows wider, never smaller.
FIGSIZE = (6.0, 4.2)

PHASE_COLORS = {"compute": "#4c72b0", "halo": "#dd8452", "comm_exposed": "#c44e52",
                "io": "#55a868", "other": "#8c8c8c", "halo_comm": "#e07b39",
                "halo_local": "#f2c094"}
#: halo_local is the halo layers' local work (copying each input into a padded buffer,
#: writing the zero boundary, unpacking): it is there on one rank too, where no message moves,
#: so it is named for what it does, not "halo exchange".
PHASE_LABELS = {"compute": "compute", "halo": "halo layers (exchange + padding)",
                "comm_exposed": "exposed allreduce", "io": "I/O wait",
                "other": "other (untimed)",
                "halo_comm": "halo exchange (waiting for messages)",
                "halo_local": "padding & buffer copies (local)"}
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
    fig, ax = plt.subplots(figsize=FIGSIZE)
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
    v = table[["speedup", "ideal_speedup"]].to_numpy(float)
    v = v[np.isfinite(v) & (v > 0)]
    if len(v):  # a tick at every power of two the points span, written 0.5, 1, 2 (not 2^-1)
        ticks = 2.0 ** np.arange(np.floor(np.log2(v.min())), np.ceil(np.log2(v.max())) + 1)
        ax.set_yticks(ticks)
        ax.set_yticklabels([f"{t:g}" for t in ticks])
    _rank_axis(ax, table["ranks"])
    ax.set_ylabel("speedup over the baseline (95% bootstrap interval)")
    ax.set_title("Speedup")
    _dedupe_legend(ax, fontsize=7)
    return _save(fig, path)


def _by_ranks(table, column, ylabel, title, path, ideal=None) -> tuple[Path, Axes]:
    fig, ax = plt.subplots(figsize=FIGSIZE)
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
    ax.set_ylim(bottom=0)  # a ratio (efficiency) or a rate compared across points: from zero
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
    """Log y axis when the values span more than 8x (else linear from zero: readable ticks,
    and heights that compare as ratios)."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v) & (v > 0)]
    if len(v) and v.max() > 8 * v.min():
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)


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

    The halo layers' time is split into the exchange (waiting for messages) and local
    padding & buffer copies (there on one rank too, with no message); where the records do
    not split it, it is one hatched bar labelled so. Unmeasured phases are named above
    their bar (their time is in "other"); the labels of oversubscribed points say so.

    Args:
        table: The scaling table.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    x = np.arange(len(table))
    fig, ax = plt.subplots(figsize=(max(FIGSIZE[0], 0.9 * len(table) + 4.5), FIGSIZE[1]))
    bottom = np.zeros(len(table))
    split = table["t_halo_comm"].notna().to_numpy() if "t_halo_comm" in table else \
        np.zeros(len(table), bool)
    for phase in stats.BREAKDOWN_PHASES:
        if phase == "halo_comm" and (~split).any():  # unsplit halo: one hatched bar
            h = np.where(split, 0.0, table["t_halo"].fillna(0).clip(lower=0).to_numpy())
            ax.bar(x, h, bottom=bottom, color=PHASE_COLORS["halo"], hatch="//",
                   edgecolor="white", label="halo layers (exchange/padding split not recorded)")
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
    fig, ax = plt.subplots(figsize=(max(FIGSIZE[0], 0.9 * len(table) + 3.5), FIGSIZE[1]))
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


#: The bytes of a step, each kind its own bar: (column, name, colour).
BYTE_KINDS = (("bytes_halo_per_step", "halo exchange", PHASE_COLORS["halo_comm"]),
              ("bytes_allreduce_per_step", "gradient allreduce", PHASE_COLORS["comm_exposed"]),
              ("bytes_read_per_step", "dataset reads", PHASE_COLORS["io"]))


def _label_bars(ax, bars, values) -> None:
    """Each bar's value as human-readable bytes above it: a small bar beside a large one
    still says what it is."""
    for bar, v in zip(bars, values):
        if np.isfinite(v):
            ax.annotate(format_bytes(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        textcoords="offset points", xytext=(0, 2), ha="center", va="bottom",
                        fontsize=7, rotation=90 if len(bars) > 6 else 0)


def bytes_plot(table: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Bytes moved per step (sum over ranks, median over steps) per (config, p): one bar per
    kind (halo exchange, allreduce, reads) from zero, in one binary unit, each labelled.

    Args:
        table: The scaling table.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    kinds = [k for k in BYTE_KINDS if k[0] in table and np.isfinite(table[k[0]].to_numpy(
        float)).any()]
    x = np.arange(len(table))
    fig, ax = plt.subplots(figsize=(max(FIGSIZE[0], 1.1 * len(table) + 3.5), FIGSIZE[1]))
    top = max([np.nanmax(table[c].to_numpy(float)) for c, _, _ in kinds] or [0.0])
    unit, scale = bytes_unit(top)
    width = 0.8 / max(len(kinds), 1)
    for i, (col, name, color) in enumerate(kinds):
        v = table[col].to_numpy(float)
        bars = ax.bar(x + (i - (len(kinds) - 1) / 2) * width, np.nan_to_num(v) / scale, width,
                      color=color, label=name)
        _label_bars(ax, bars, v)
    ax.set_xticks(x)
    ax.set_xticklabels(_point_labels(table))
    ax.set_xlabel("ranks")
    ax.set_ylabel(f"{unit} per step (sum over ranks)")
    ax.set_ylim(0, max(top / scale, 1.0) * 1.2)
    ax.set_title("Bytes moved per step")
    ax.grid(True, axis="y", alpha=0.3)
    if kinds:
        ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def memory_plot(table: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Peak memory of the largest rank vs ranks, from zero (what fraction each scale saves is
    read off the heights), each point labelled in human-readable bytes.

    Args:
        table: The scaling table.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    fig, ax = plt.subplots(figsize=FIGSIZE)
    peak = table["peak_mem_max"].to_numpy(float)
    unit, scale = bytes_unit(np.nanmax(peak) if np.isfinite(peak).any() else 0.0)
    for config, t in table.groupby("config"):
        y = t["peak_mem_max"].to_numpy(float)
        ax.plot(t["ranks"], y / scale, "o-", label=str(config))
        for p, v in zip(t["ranks"], y):
            if np.isfinite(v):
                ax.annotate(format_bytes(v), (p, v / scale), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=8)
        if "oversubscribed" in t:
            _mark_oversubscribed(ax, t["ranks"], y / scale, t["oversubscribed"])
    _rank_axis(ax, table["ranks"])
    ax.set_ylim(bottom=0, top=max(np.nanmax(peak / scale) if np.isfinite(peak).any() else 0,
                                   1.0) * 1.2)
    ax.set_ylabel(f"peak memory of the largest rank ({unit})")
    ax.set_title("Peak memory per rank")
    if ax.get_legend_handles_labels()[0]:
        _dedupe_legend(ax, fontsize=8)
    return _save(fig, path)


def _ratio_line(ax, ranks, ratio, label, color=None) -> None:
    """A ratio per point, each labelled with its value, and the line at 1."""
    ax.plot(ranks, ratio, "o-", color=color, label=label)
    for p, r in zip(ranks, ratio):
        if np.isfinite(r):
            ax.annotate(f"{r:.2f}", (p, r), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)
    ax.axhline(1.0, color="black", ls=":", alpha=0.6)


def _finish(fig, ax, ranks, path) -> Path:
    _rank_axis(ax, ranks)
    if ax.get_legend_handles_labels()[0]:
        _dedupe_legend(ax, fontsize=8)
    return _save(fig, path)


def _ratio_plot(t: pd.DataFrame, ylabel: str, title: str, path, flags=None) -> Path:
    """One ratio per (config, p) vs ranks, from zero (a ratio's size is its height), the
    line at 1, each point labelled; ``flags(t)``: the points to mark oversubscribed."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for config, c in t.groupby("config"):
        _ratio_line(ax, c["ranks"], c["ratio"], str(config))
        if flags is not None:
            _mark_oversubscribed(ax, c["ranks"], c["ratio"], flags(c))
    r = t["ratio"].to_numpy(float)
    ax.set_ylim(0, max(np.nanmax(r) if np.isfinite(r).any() else 0.0, 1.0) * 1.2)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _finish(fig, ax, t["ranks"], path)


def compare_plot(cmp: pd.DataFrame, labels: tuple, path: str | os.PathLike) -> Path:
    """Before/after: median step time of both sweeps vs ranks, with the run-to-run range
    (the ratio per point is :func:`compare_ratio_plot`).

    Args:
        cmp: The comparison table (``compare_tables``).
        labels: Names of the two sweeps (before, after).
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for config, t in cmp.groupby("config"):
        for side, style, lab in (("a", "o-", labels[0]), ("b", "s--", labels[1])):
            y = t[f"t_step_median_{side}"].to_numpy(float)
            err = np.vstack([y - t[f"t_step_run_min_{side}"], t[f"t_step_run_max_{side}"] - y])
            ax.errorbar(t["ranks"], y, yerr=np.nan_to_num(np.clip(err, 0, None)), fmt=style,
                        capsize=3, label=f"{config}: {lab}")
    _maybe_log(ax, cmp[["t_step_median_a", "t_step_median_b"]].to_numpy(float).ravel())
    ax.set_ylabel("median step time (s); bars: run-to-run range")
    ax.set_title("Step time, before and after")
    return _finish(fig, ax, cmp["ranks"], path)


def compare_ratio_plot(cmp: pd.DataFrame, labels: tuple, path: str | os.PathLike) -> Path:
    """The ratio after / before of the median step time per point (below 1 = faster).

    Args:
        cmp: The comparison table (``compare_tables``).
        labels: Names of the two sweeps (before, after).
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    return _ratio_plot(cmp, f"step time ratio {labels[1]} / {labels[0]}",
                       "Ratio per point (< 1: faster)", path,
                       lambda c: [_flag(a) or _flag(b) for a, b in
                                  zip(c["oversubscribed_a"], c["oversubscribed_b"])])


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
    """Measured vs predicted step time per config (the ratio per point is
    :func:`predicted_ratio_plot`).

    Args:
        pred: The table of ``predicted_vs_measured``.
        title: What made the prediction (``"hpcpar plan, machine local"``).
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for config, t in pred.groupby("config"):
        line, = ax.plot(t["ranks"], t["t_step_measured"], "o-", label=f"{config}: measured")
        ax.plot(t["ranks"], t["t_step_predicted"], "s--", color=line.get_color(),
                label=f"{config}: predicted")
    _maybe_log(ax, pred[["t_step_measured", "t_step_predicted"]].to_numpy(float).ravel())
    ax.set_ylabel("seconds per step")
    ax.set_title(f"Step time: measured vs {title}")
    return _finish(fig, ax, pred["ranks"], path)


def predicted_ratio_plot(pred: pd.DataFrame, path: str | os.PathLike) -> Path:
    """The ratio measured / predicted step time per point (1 = the model is right).

    Args:
        pred: The table of ``predicted_vs_measured``.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    return _ratio_plot(pred, "measured / predicted", "Ratio per point (1: the model is right)",
                       path)


def loss_curves_plot(curves: pd.DataFrame, curve: str, title: str,
                     path: str | os.PathLike) -> Path:
    """One ``curve`` ("train" or "val") of every run against samples seen (steps where a
    run's global batch is unknown), overlaid: one colour per (config, ranks), so points that
    learnt the same lie on one line.

    Args:
        curves: The curves of :func:`hpcpar.analysis.learning.learning_curves`.
        curve: Which curve to draw.
        title: The figure's title.
        path: The PNG to write.

    Returns:
        The PNG's path.
    """
    t = curves[curves["curve"] == curve]
    x = "samples" if len(t) and t["samples"].notna().all() else "step"
    fig, ax = plt.subplots(figsize=FIGSIZE)
    several = t["config"].nunique() > 1
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((config, ranks), g) in enumerate(t.groupby(["config", "ranks"], sort=True)):
        label = f"{config} @ {ranks} ranks" if several else f"{ranks} ranks"
        for j, (_, run) in enumerate(g.groupby("run", sort=True)):
            run = run.sort_values("step")
            ax.plot(run[x], run["loss"], marker="o" if curve == "val" else None, ms=4,
                    color=colors[i % len(colors)], alpha=0.8, label=label,
                    ls="-" if j == 0 else "--")
    ax.set_xlabel("samples seen" if x == "samples" else "step")
    ax.set_ylabel("validation loss" if curve == "val" else "training loss (window mean)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        _dedupe_legend(ax, fontsize=8)
    else:
        ax.text(0.5, 0.5, "no curve recorded (metrics.json)", ha="center",
                transform=ax.transAxes)
    return _save(fig, path)
