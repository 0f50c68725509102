"""Before/after: two sweeps side by side, one row per (config, ranks), with the ratio.

``ratio = T_after / T_before`` of the median step times (below 1: the change made the point
faster). Points are matched by config and rank count; when each side holds a single config
under different names (a renamed job), they are matched by rank count alone.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from hpcpar.errors import RunDirError

from . import plots
from .load import load
from .render import Section, markdown_table, render_html, render_markdown, rows_of
from .scaling import scaling_table
from .settings import split_unlike

__all__ = ["COMPARE_COLUMNS", "compare_tables", "write_comparison"]

_SIDE = ("t_step_median", "t_step_run_min", "t_step_run_max", "t_step_cv", "speedup",
         "efficiency", "throughput", "oversubscribed", "partial", "runs", "steps")
#: Columns of compare.csv.
COMPARE_COLUMNS = ("config", "ranks", *(f"{c}_{s}" for s in "ab" for c in _SIDE), "ratio",
                   "note")
SHOWN = (("config", "config", "{}"), ("ranks", "ranks", "{}"),
         ("t_step_median_a", "before: step time (s)", "{:.4g}"),
         ("t_step_median_b", "after: step time (s)", "{:.4g}"),
         ("ratio", "after / before", "{:.3f}"),
         ("efficiency_a", "before: efficiency", "{:.3f}"),
         ("efficiency_b", "after: efficiency", "{:.3f}"), ("note", "note", "{}"))


def _true(value) -> bool:
    return value is not None and value == value and bool(value)


def compare_tables(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Join two scaling tables point by point.

    Args:
        a: The scaling table before.
        b: The scaling table after.

    Returns:
        ``COMPARE_COLUMNS``: each side's numbers (suffix ``_a`` / ``_b``) and
        ratio = t_step_median_b / t_step_median_a; a point on one side only has NaNs on the
        other and a note.
    """
    a, b = a.copy(), b.copy()
    ca, cb = set(a["config"]), set(b["config"])
    if len(ca) == 1 and len(cb) == 1 and ca != cb:
        b["config"] = next(iter(ca))
    keep = ["config", "ranks", *_SIDE]
    m = a[keep].merge(b[keep], on=["config", "ranks"], how="outer", suffixes=("_a", "_b"))
    m["ratio"] = m["t_step_median_b"] / m["t_step_median_a"]
    notes = []
    for r in m.to_dict("records"):
        n = []
        if pd.isna(r["t_step_median_a"]) and pd.isna(r["runs_a"]):
            n.append("only after")
        elif pd.isna(r["t_step_median_b"]) and pd.isna(r["runs_b"]):
            n.append("only before")
        n += [f"{side} {what}" for what in ("partial", "oversubscribed")
              for side, k in (("before", "a"), ("after", "b")) if _true(r[f"{what}_{k}"])]
        notes.append("; ".join(n))
    m["note"] = notes
    return m[list(COMPARE_COLUMNS)].sort_values(["config", "ranks"]).reset_index(drop=True)


def _side(paths, mode, warmup, strict):
    runs, steps = load(paths)
    runs = split_unlike(runs, strict)
    return scaling_table(runs, steps, mode=mode, warmup=warmup, strict=strict)


def write_comparison(before: Sequence[str | os.PathLike], after: Sequence[str | os.PathLike],
                     out: str | os.PathLike, mode: str | None = None, warmup: int | None = None,
                     strict: bool = False,
                     labels: tuple | None = None) -> tuple[pd.DataFrame, dict]:
    """Write ``compare.csv``, ``compare.png`` (step times), ``compare-ratio.png``, ``compare.md``
    and ``compare.html`` into out.

    Args:
        before: Run or sweep directories of the "before" side.
        after: Those of the "after" side.
        out: The output directory (created).
        mode: As for ``write_report``, applied to both sides.
        warmup: As for ``write_report``, applied to both sides.
        strict: As for ``write_report``, applied to both sides.
        labels: Names of the two sides (default: the directory names).

    Returns:
        ``(table, files)``: the comparison table and name -> path of the files written.
    """
    before, after = [before] if isinstance(before, (str, Path)) else before, \
        [after] if isinstance(after, (str, Path)) else after
    labels = labels or (Path(before[0]).name or "before", Path(after[0]).name or "after")
    if labels[0] == labels[1]:
        labels = (f"before ({labels[0]})", f"after ({labels[1]})")
    cmp = compare_tables(_side(before, mode, warmup, strict), _side(after, mode, warmup, strict))
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        files = {"compare.csv": out / "compare.csv"}
        cmp.to_csv(files["compare.csv"], index=False)
        files["compare.png"] = plots.compare_plot(cmp, labels, out / "compare.png")
        files["compare-ratio.png"] = plots.compare_ratio_plot(cmp, labels,
                                                              out / "compare-ratio.png")
        both = cmp[np.isfinite(cmp["ratio"])]
        if len(both):
            faster = int((both["ratio"] < 1).sum())
            worst = both.loc[both["ratio"].idxmax()]
            line = (f"Verdict: {labels[1]} vs {labels[0]}: median ratio "
                    f"{both['ratio'].median():.3f} over {len(both)} point(s); faster at "
                    f"{faster}; largest ratio {worst['ratio']:.3f} at {worst['config']} @ "
                    f"{worst['ranks']} ranks.")
        else:
            line = "Verdict: no point measured on both sides."
        secs = [Section("Verdict", [line]),
                Section("Step time, before and after", [
                    f"Before: {', '.join(map(str, before))}. After: "
                    f"{', '.join(map(str, after))}. Ratio = after / before of the median step "
                    "time (< 1: faster)."], rows_of(cmp, SHOWN)),
                Section("Plots", images=[("compare", files["compare.png"]),
                                         ("compare ratio", files["compare-ratio.png"])])]
        title = f"hpcpar comparison: {labels[1]} vs {labels[0]}"
        stamp = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        files["compare.md"] = out / "compare.md"
        files["compare.md"].write_text(render_markdown(secs, title) + f"\n_Generated {stamp}._\n")
        files["compare.html"] = out / "compare.html"
        files["compare.html"].write_text(render_html(secs, title))
    except OSError as exc:
        raise RunDirError(f"{exc.filename or out}: cannot write the comparison "
                          f"({exc.strerror or exc})") from None
    cmp.attrs["headline"] = markdown_table(*rows_of(cmp, SHOWN))
    cmp.attrs["verdict"] = line
    return cmp, files
