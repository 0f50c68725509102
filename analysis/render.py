"""The report: scaling.csv, runs.csv, PNG plots, report.md and a self-contained report.html.

Markdown and HTML are rendered from the same list of sections, so they always say the same.
"""

from __future__ import annotations

import base64
import datetime as _dt
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import pandas as pd
from markupsafe import Markup

from hpcpar._tables import text_table
from hpcpar._units import format_bytes
from hpcpar.errors import RunDirError
from hpcpar.formats.records import SCHEMA_VERSION

from . import learning, plots, stats
from .load import load
from .predicted import predicted_vs_measured
from .scaling import scaling_table
from .settings import split_unlike
from .suspect import superlinear_warnings, version_warning

__all__ = ["HEADLINE", "BREAKDOWN", "SPREAD", "RESOURCES", "RUNS", "ENVIRONMENT", "DEFINITIONS",
           "LEARNING", "Section",
           "Report", "rows_of", "markdown_table", "headline_table", "verdict", "amdahl_lines",
           "render_markdown", "CSS", "HTML_TEMPLATE", "render_html", "write_report"]

#: The mark of a value outside the range where it means what its column claims.
FLAG = "FLAGGED"
PREDICTED = (("config", "config", "{}"), ("ranks", "ranks", "{}"), ("grid", "grid", "{}"),
             *((f"t_{p}_{w}", f"{p} {w[:4]}.", "{:.4g}") for p in ("step", "compute", "halo",
                                                                    "comm_exposed", "io")
               for w in ("measured", "predicted")),
             ("ratio", "step measured/predicted", "{:.3f}"), ("note", "note", "{}"))
#: Headline columns: (table column, header, format); ``_display`` adds the text columns.
HEADLINE = (("config", "config", "{}"), ("ranks", "ranks", "{}"), ("grid", "grid", "{}"),
            ("t_step_median", "step time median (s)", "{:.4g}"),
            ("t_step_cv", "CV", "{:.3f}"), ("speedup", "speedup", "{:.3f}"),
            ("speedup_ci", "speedup 95% CI", "{}"),
            ("show_efficiency", "efficiency", "{}"), ("show_karp_flatt", "Karp-Flatt", "{}"),
            ("throughput", "samples/s", "{:.4g}"),
            ("placement", "ranks/node x threads : cores", "{}"),
            ("show_load", "host load before / at end", "{}"),
            ("oversub", "CPU shared", "{}"), ("partial", "partial", "{}"))
BREAKDOWN = (("config", "config", "{}"), ("ranks", "ranks", "{}"),
             *((f"show_{p}", f"{plots.PHASE_LABELS[p]}", "{}")
               for p in ("compute", "halo_comm", "halo_local", "halo", "comm_exposed", "io",
                         "other")),
             ("imbalance", "imbalance max/mean", "{:.3f}"), ("steps", "steps", "{}"),
             ("runs", "runs", "{}"))
SPREAD = (("config", "config", "{}"), ("ranks", "ranks", "{}"), ("runs", "runs", "{}"),
          ("steps", "steps", "{}"), ("t_step_median", "median (s)", "{:.4g}"),
          ("t_step_std", "std (s)", "{:.3g}"), ("t_step_cv", "CV", "{:.3f}"),
          ("run_range", "run medians min..max (s)", "{}"),
          ("speedup_ci", "speedup 95% CI", "{}"), ("efficiency_ci", "efficiency 95% CI", "{}"))
RESOURCES = (("config", "config", "{}"), ("ranks", "ranks", "{}"),
             ("bytes_halo_per_step", "halo exchange per step", format_bytes),
             ("bytes_allreduce_per_step", "allreduce per step", format_bytes),
             ("bytes_read_per_step", "reads per step", format_bytes),
             ("peak_mem_max", "peak memory of the largest rank", format_bytes),
             ("placement", "ranks/node x threads : cores", "{}"),
             ("oversub", "CPU shared", "{}"))
#: The learning view: final losses and metric per point, and the loss's difference from the
#: config's baseline point (see ``learning``).
LEARNING = (("config", "config", "{}"), ("ranks", "ranks", "{}"), ("runs", "runs", "{}"),
            ("steps", "steps", "{:.0f}"), ("final_loss", "final loss (train)", "{:.5g}"),
            ("final_val_loss", "final validation loss", "{:.5g}"),
            ("show_metric", "final metric", "{}"),
            ("show_diff", "loss vs baseline point", "{}"))
#: The learning plots: (curve, files key, alt text, title, file name).
LEARNING_PLOTS = (("train", "loss curves", "loss curves: training loss against samples seen, "
                   "per rank count", "Training loss", "loss.png"),
                  ("val", "validation curves", "validation loss curves against samples seen, "
                   "per rank count", "Validation loss", "val_loss.png"))
#: The runs, in two tables that each fit a page: what ran and where (RUNS), and with what
#: software (ENVIRONMENT); the run's name joins them.
RUNS = (("name", "run", "{}"), ("config", "config", "{}"), ("ranks", "ranks", "{}"),
        ("grid_spec", "grid", "{}"), ("settings_hash", "settings", "{}"),
        ("cores_per_node", "cores/node", "{:.0f}"), ("ranks_per_node", "ranks/node", "{:.0f}"),
        ("threads_per_rank", "threads/rank", "{:.0f}"),
        ("status", "status", "{}"), ("steps_complete", "steps", "{}"))
ENVIRONMENT = (("name", "run", "{}"), ("start_time", "start", "{}"),
               ("hostnames", "hosts", "{}"), ("slurm_job_id", "Slurm job", "{}"),
               ("git_commit", "commit", "{:.10}"), ("torch", "torch", "{}"),
               ("mpi_library", "MPI", "{}"))

DEFINITIONS = [
    "Step time of a step T_s = max over ranks of t_step; warm-up steps dropped "
    "(first max(1, n/10) of each start/resume unless --warmup).",
    "CV = std / mean of T_s. Throughput = median_s(global samples_s / T_s).",
    "q = p / p0 (p0: smallest rank count of the config). Speedup S = (W/T)/(W0/T0) with W the "
    "work per step: strong S = T(p0)/T(p), weak S = q T(p0)/T(p).",
    "Efficiency E = S / q: strong p0 T(p0) / (p T(p)), weak T(p0) / T(p).",
    "Karp-Flatt serial fraction e = (1/S - 1/q) / (1 - 1/q). Amdahl fit: least squares f in "
    "S(q) = 1 / (f + (1 - f)/q).",
    "Fractions: sum over ranks and steps of each phase / sum of t_step; compute = t_fwd + "
    "t_bwd + t_opt - t_halo; halo layers = t_halo = halo exchange (t_halo_wait: waiting for "
    "neighbours' messages, the graph all-to-all) + padding & buffer copies (t_halo - "
    "t_halo_wait: copying each input into a padded buffer, writing the zero boundary, "
    "unpacking; local work, present on one rank too); other = t_step minus the measured "
    "phases (untimed loop overhead, and the time of any phase marked 'unmeasured'). "
    "Imbalance = max_r / mean_r of compute time.",
    "Intervals: 95% percentile bootstrap (1000 replicates) of the median step time, drawing "
    "runs with replacement and then steps within each run; speedup and efficiency are "
    "computed per replicate (baseline and point drawn independently).",
    "Fitted law: Amdahl S = 1/(f + (1-f)/q) for strong, Gustafson S = q - f (q-1) for weak "
    "scaling (least squares f). Quality R^2 = 1 - sum (S - S_fit)^2 / sum (S - mean S)^2 "
    "over the points; drawn only with >= 3 rank counts, non-decreasing speedup, "
    "0 <= f <= 1 and R^2 >= 0.9.",
    "Oversubscribed: ranks per node x threads per rank > cores per node (SLURM_CPUS_ON_NODE "
    "under Slurm, else the ranks' CPU affinity), from meta.json 'machine'.",
    "Host load: the 1-minute load average of rank 0's host when the point's runs began and "
    "ended (meta.json 'host_load'; the largest over its runs). BUSY HOST: the load before "
    "exceeded the cores the point left idle (cores - ranks x threads) by more than one, or "
    "the load at the end exceeded what its own ranks explain (ranks x threads, at least the "
    "cores) by more than one: other work shared the cores, so the point times CPU sharing, "
    "like an oversubscribed one.",
    f"{FLAG}: a number outside the range where it means what its column says. A serial "
    "fraction (Karp-Flatt e, the fitted f) is a share of the work, so it lies in [0, 1]: "
    "above 1 the point ran slower than on fewer ranks, below 0 it beat its cores. An "
    "efficiency above 1 beats the cores used (see the warnings for the likely cause: "
    "usually the baseline was slowed, not the point sped up). Neither is a measurement of "
    "the code's serial part.",
    "Like for like: runs of one config share a row only when their job settings (meta.json "
    "'job' without grid, resources and global batch) hash the same; others get their own "
    "row, named 'CONFIG [settings HASH]', with the differing keys in the notes.",
]


@dataclass
class Section:
    """One section of a report, rendered alike to Markdown and HTML.

    Attributes:
        title: The section heading.
        text: Paragraphs, or bullet items when ``bullets`` is set.
        table: ``(header, rows)`` of text cells, or None for no table.
        images: ``(alt, path)`` of each PNG shown.
        bullets: Render ``text`` as a bullet list instead of paragraphs.
    """

    title: str
    text: list = field(default_factory=list)      # paragraphs / bullet items
    table: tuple | None = None                     # (header list, rows of str)
    images: list = field(default_factory=list)     # (alt, Path)
    bullets: bool = False


@dataclass
class Report:
    """What [write_report][hpcpar.analysis.render.write_report] wrote.

    Attributes:
        out: The report directory.
        table: The scaling table, one row per (config, ranks).
        runs: One row per run.
        files: Name (``"report.html"``, ``"scaling.csv"``...) -> path of every file written.
        headline: The headline table as text (what ``hpcpar report`` prints).
        skipped: The one-line reason of each run left out.
        verdict: The one-line verdict at the top of the report.
        warnings: One line per fact that makes the report suspect (runs of different
            hpcpar versions, a point that beats the cores it used); shown under the verdict.
        learning: The one-line learning verdict: whether every point learnt the same.
        learn: The learning table, one row per (config, ranks) (``learning.learning_table``).
    """

    out: Path
    table: pd.DataFrame
    runs: pd.DataFrame
    files: dict
    headline: str
    skipped: list = field(default_factory=list)  # "reason" of each run left out
    verdict: str = ""
    warnings: list = field(default_factory=list)
    learning: str = ""
    learn: pd.DataFrame | None = None


def _cell(value, fmt: str | Callable) -> str:
    if isinstance(value, bool):
        return "PARTIAL" if value else ""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return fmt(value) if callable(fmt) else fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def rows_of(df: pd.DataFrame,
            spec: Sequence[tuple[str, str, str | Callable]]) -> tuple[list, list]:
    """Format a table's columns as text cells for a report table.

    Args:
        df: The table to show.
        spec: ``(column, header, format)`` of each column shown, e.g. :data:`HEADLINE`; the
            format a ``str.format`` pattern or a function of the value (``format_bytes``).

    Returns:
        ``(header, rows)``: the headers and one list of text cells per row of ``df``.
    """
    header = [h for _, h, _ in spec]
    rows = [[_cell(r[c], f) for c, _, f in spec] for r in df.to_dict("records")]
    return header, rows


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Render text cells as a Markdown pipe table (``|`` in cells escaped).

    Args:
        header: The column headers.
        rows: The rows, each a list of text cells.

    Returns:
        The table as text.
    """
    return text_table(header, rows)


def _num(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _interval(lo, hi, fmt="{:.3f}") -> str:
    return f"[{fmt.format(lo)}, {fmt.format(hi)}]" if _num(lo) and _num(hi) else "-"


def _flagged(value, fmt: str, low: float | None = None, high: float | None = None) -> str:
    """A number as text, followed by :data:`FLAG` and the bound it crosses when it lies
    outside ``[low, high]`` (a serial fraction above 1 is no fraction)."""
    text = _cell(value, fmt)
    if not _num(value):
        return text
    if high is not None and value > high + 1e-9:
        return f"{text} {FLAG} >{high:g}"
    if low is not None and value < low - 1e-9:
        return f"{text} {FLAG} <{low:g}"
    return text


def _display(table: pd.DataFrame) -> pd.DataFrame:
    """The scaling table plus the text columns of the report's tables."""
    t = table.copy()

    def opt(v):
        return str(int(v)) if _num(v) else "?"

    t["speedup_ci"] = [_interval(a, b) for a, b in zip(t["speedup_lo"], t["speedup_hi"])]
    t["efficiency_ci"] = [_interval(a, b) for a, b in zip(t["efficiency_lo"],
                                                           t["efficiency_hi"])]
    t["run_range"] = [_interval(a, b, "{:.4g}").strip("[]").replace(", ", "..")
                      if _num(a) else "-" for a, b in zip(t["t_step_run_min"],
                                                           t["t_step_run_max"])]
    t["placement"] = [f"{opt(r)}x{opt(th)} : {opt(c)}" for r, th, c in
                      zip(t["ranks_per_node"], t["threads_per_rank"], t["cores_per_node"])]
    t["oversub"] = [" ".join(w for w, on in (("OVERSUBSCRIBED", o is True),
                                              ("BUSY HOST", b is True)) if on)
                    or ("" if o is False else "unknown")
                    for o, b in zip(t["oversubscribed"], t["busy_host"])]
    t["show_load"] = [f"{_cell(a, '{:.2f}')} / {_cell(b, '{:.2f}')}" if _num(a) or _num(b)
                      else "-" for a, b in zip(t["load_before"], t["load_after"])]
    t["show_efficiency"] = [_flagged(v, "{:.3f}", high=1.0) for v in t["efficiency"]]
    t["show_karp_flatt"] = [_flagged(v, "{:.4f}", low=0.0, high=1.0) for v in t["karp_flatt"]]
    for p in ("compute", "halo_comm", "halo_local", "halo", "comm_exposed", "io", "other"):
        t[f"show_{p}"] = [f"{v:.1%}" if _num(v) else "unmeasured" if n else "-"
                          for v, n in zip(t[f"frac_{p}"], t["steps"])]
    # no byte left the rank for a halo: there was no neighbour, so no exchange to show as 0%
    t.loc[t["bytes_halo_per_step"] == 0, "show_halo_comm"] = "none (no neighbour)"
    return t


def headline_table(table: pd.DataFrame) -> str:
    """The headline table (Markdown pipe table, also readable in a terminal).

    Args:
        table: The scaling table.

    Returns:
        The table as text.
    """
    return markdown_table(*rows_of(_display(table), HEADLINE))


def verdict(table: pd.DataFrame, threshold: float = 0.7) -> str:
    """The one-line verdict at the top of the report, per config: best speedup (where),
    the first rank count whose efficiency drops below ``threshold``, the largest phase at
    the largest scale, and the oversubscribed points.

    Args:
        table: The scaling table.
        threshold: The efficiency that counts as acceptable.

    Returns:
        One line.
    """
    parts = []
    for config, t in table.groupby("config", sort=True):
        t = t[t["speedup"].notna()].sort_values("ranks")
        if not len(t):
            parts.append(f"{config}: no usable steps")
            continue
        best = t.loc[t["speedup"].idxmax()]
        scaled = "scaled " if t["mode"].iloc[0] == "weak" else ""
        text = (f"{config} ({t['mode'].iloc[0]}): best {scaled}speedup {best['speedup']:.2f}x "
                f"at {best['ranks']} ranks "
                f"(efficiency {best['efficiency']:.2f})")
        low = t[t["efficiency"] < threshold]
        text += (f"; efficiency below {threshold:g} from {low['ranks'].iloc[0]} ranks "
                 f"({low['efficiency'].iloc[0]:.2f})" if len(low) else
                 f"; efficiency >= {threshold:g} up to {t['ranks'].iloc[-1]} ranks")
        last = t.iloc[-1]
        shares = {p: last[f"frac_{p}"] for p in stats.BREAKDOWN_PHASES
                  if _num(last[f"frac_{p}"])}
        if not _num(last["frac_halo_comm"]) and _num(last["frac_halo"]):
            shares["halo"] = last["frac_halo"]
        if shares:
            top = max(shares, key=lambda p: shares[p])
            text += (f"; largest phase at {last['ranks']} ranks: {plots.PHASE_LABELS[top]} "
                     f"({shares[top]:.0%})")
        over = t[t["oversubscribed"] == True]["ranks"].tolist()  # noqa: E712 - None = unknown
        if over:
            text += f"; OVERSUBSCRIBED at {', '.join(map(str, over))} ranks"
        busy = t[t["busy_host"] == True]["ranks"].tolist()  # noqa: E712 - None = unknown
        if busy:
            text += f"; BUSY HOST at {', '.join(map(str, busy))} ranks"
        odd = t[(t["efficiency"] > 1 + 1e-9) | (t["karp_flatt"] < -1e-9)
                | (t["karp_flatt"] > 1 + 1e-9)]["ranks"].tolist()
        if odd:
            text += (f"; efficiency or serial fraction {FLAG} (outside its meaningful range) "
                     f"at {', '.join(map(str, odd))} ranks")
        if t["partial"].any():
            text += "; some points PARTIAL"
        parts.append(text)
    return "Verdict: " + " | ".join(parts) + "."


def amdahl_lines(table: pd.DataFrame) -> list[str]:
    """One line per config: the fitted law (Amdahl for strong, Gustafson for weak scaling),
    its R^2 and whether it is drawn (and why not).

    Args:
        table: The scaling table.

    Returns:
        One line of text per config.
    """
    out = []
    for config, t in table.groupby("config", sort=True):
        r = t.iloc[0]
        law = str(r["fit_law"] or "").capitalize()
        if not _num(r["fit_serial_fraction"]):
            why = r["fit_note"] or "one rank count"
            out.append(f"{config}: no {law or 'scaling-law'} fit ({why})")
            continue
        r2 = f"{r['fit_r2']:.3f}" if _num(r["fit_r2"]) else "undefined"
        f = _flagged(r["fit_serial_fraction"], "{:.4f}", low=0.0, high=1.0)
        out.append(f"{config}: {law} serial fraction f = {f}, "
                   f"R^2 = {r2}; " + ("drawn" if r["fit_shown"] else
                                      f"not drawn: {r['fit_note']}"))
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(text)).strip("-") or "config"


def _write_plots(out: Path, table, runs, steps) -> dict:
    files = {"speedup": plots.speedup_plot(table, out / "speedup.png"),
             "efficiency": plots.efficiency_plot(table, out / "efficiency.png"),
             "breakdown": plots.breakdown_plot(table, out / "breakdown.png"),
             "step_times": plots.step_times_plot(table, steps, runs, out / "step_times.png"),
             "throughput": plots.throughput_plot(table, out / "throughput.png"),
             "bytes": plots.bytes_plot(table, out / "bytes.png"),
             "memory": plots.memory_plot(table, out / "memory.png")}
    configs = sorted(runs["config"].unique())
    for config in configs:
        cruns = runs[runs["config"] == config].sort_values(["partial", "ranks"],
                                                           ascending=[False, True])
        for run in cruns["run"][::-1]:  # the largest complete run, else the largest partial
            rsteps = steps[steps["run"] == run] if len(steps) else steps
            if len(rsteps):
                name = "imbalance.png" if len(configs) == 1 else f"imbalance-{_slug(config)}.png"
                row = cruns[cruns["run"] == run].iloc[0]
                title = f"{config}: {row['ranks']} ranks ({row['grid_spec']}), {row['name']}"
                files[f"imbalance:{config}"] = plots.imbalance_heatmap(rsteps, title, out / name)
                break
    return files


def _learning_section(learn: pd.DataFrame, images: Sequence) -> Section:
    """Did the points learn the same: the curves overlaid, final values, and the verdict."""
    t = learn.copy()
    t["show_metric"] = [f"{m} {v:.5g}" if m and _num(v) else "-"
                        for m, v in zip(t["metric"], t["final_metric"])]
    t["show_diff"] = ["-" if not _num(d) else f"{d:+.2%}" + (
        "" if same else " LEARNT DIFFERENTLY") for d, same in zip(t["loss_diff"],
                                                                  t["learnt_same"])]
    return Section("Learning", [
        learning.learning_verdict(learn),
        "Loss curves from each run's metrics.json (training loss: the mean over each logging "
        "window; validation loss: each validation and the final one), against samples seen, "
        "overlaid across rank counts: points that learnt the same lie on one curve."],
        rows_of(t, LEARNING), images=list(images))


def _sections(table, runs, files, paths, mode, warmup, skipped=(),
              threshold=0.7, warnings=(), learn_section=None) -> list[Section]:
    notes = [f"{r['config']} @ {r['ranks']} ranks: {r['note']}"
             for r in table.to_dict("records") if r["note"]]
    notes += [f"skipped (unreadable): {reason}" for reason in skipped]
    partial = bool(table["partial"].any())
    where = ", ".join(map(str, paths)) if len(paths) <= 2 else \
        f"{len(paths)} paths under {Path(os.path.commonpath([str(p) for p in paths]))}"
    modes = ", ".join(sorted(set(table["mode"])))
    intro = [f"Runs: {len(runs)} from {where}. Scaling mode: {modes} "
             f"({'as asked' if mode else 'read from the runs'}). Warm-up steps dropped: "
             f"{warmup if warmup is not None else 'max(1, n/10) per run segment'}. "
             f"Record schema v{SCHEMA_VERSION}."]
    if partial:
        intro.append("Rows marked PARTIAL come from incomplete runs: see the notes.")
    over = table[table["oversubscribed"] == True]  # noqa: E712 - None = unknown
    if len(over):
        intro.append("OVERSUBSCRIBED points (ranks per node x threads per rank > cores per "
                     "node) time CPU sharing, not scaling: " + ", ".join(
                         f"{c} @ {p}" for c, p in zip(over["config"], over["ranks"])) + ".")
    busy = table[table["busy_host"] == True]  # noqa: E712 - None = unknown
    if len(busy):
        intro.append("BUSY HOST points (other work on the host, from its load average: see "
                     "the definitions) time CPU sharing too: " + ", ".join(
                         f"{c} @ {p} (load {b:.2f} before, {a:.2f} at end)" for c, p, b, a in
                         zip(busy["config"], busy["ranks"], busy["load_before"],
                             busy["load_after"])) + "; rerun them on a quiet host.")
    shown = _display(table)
    secs = [Section("Verdict", [verdict(table, threshold),
                                *([learn_section.text[0]] if learn_section else []),
                                *(f"Warning: {w}." for w in warnings)]),
            Section("Scaling", intro, rows_of(shown, HEADLINE))]
    if learn_section:
        secs.append(learn_section)
    if notes:
        secs.append(Section("Notes", notes, bullets=True))
    secs.append(Section("Plots", images=[(k, v) for k, v in files.items()]))
    secs.append(Section("Spread", ["Run-to-run and step-to-step spread of the step time; "
                                   "intervals are 95% bootstrap over runs and steps.",
                                   *amdahl_lines(table)], rows_of(shown, SPREAD)))
    secs.append(Section("Where the time goes", [
        "Share of rank time per phase. 'unmeasured': the records hold no such timing (its "
        "time is inside 'other'). Halo layers = halo exchange (waiting for neighbours' "
        "messages) + padding & buffer copies (local work: each input copied into a padded "
        "buffer and the zero boundary written, so it is there with no neighbour too; a point "
        "that sent no halo byte shows its exchange as 'none')."],
        rows_of(shown, BREAKDOWN)))
    secs.append(Section("Bytes, memory and placement", [
        "Bytes per step: sum over ranks, median over steps. Peak memory: the largest "
        "rank's."], rows_of(shown, RESOURCES)))
    ordered = runs.sort_values(["config", "ranks"])
    secs.append(Section("Runs", [], rows_of(ordered, RUNS)))
    secs.append(Section("Run environment", [], rows_of(ordered, ENVIRONMENT)))
    secs.append(Section("Definitions", DEFINITIONS, bullets=True))
    return secs


def render_markdown(secs: Sequence[Section], title: str) -> str:
    """Render report sections as a Markdown document (images linked by file name).

    Args:
        secs: The sections, in order.
        title: The document title.

    Returns:
        The Markdown text.
    """
    parts = [f"# {title}", ""]
    for s in secs:
        parts += [f"## {s.title}", ""]
        parts += [("- " + t) if s.bullets else t + "\n" for t in s.text]
        if s.bullets:
            parts.append("")
        if s.table:
            parts += [markdown_table(*s.table), ""]
        parts += [f"![{alt}]({path.name})\n" for alt, path in s.images]
    return "\n".join(parts).rstrip() + "\n"


#: The page's style. Plots are shown at their own pixel size (the figures are made to read at
#: 100%: two side by side from a 1400 px window, one a row below), never wider than the
#: page; a table wraps its headers and long cells between words (a word is split only when
#: it alone is wider than its column), and a table still too wide scrolls inside its own
#: box: the page itself never scrolls sideways.
CSS = ("body{font-family:sans-serif;max-width:1380px;margin:2em auto;padding:0 1em}"
       ".box{max-width:100%;overflow-x:auto;margin:.5em 0}"
       "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;"
       "padding:3px 7px;text-align:right;overflow-wrap:break-word;hyphens:none}"
       "th{background:#f0f0f0;vertical-align:bottom;max-width:11em}"
       ".flag{background:#ffd0d0;font-weight:bold}"
       ".plots{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0;max-width:100%}"
       "img{display:block;max-width:100%;height:auto}"
       "td:first-child,th:first-child{text-align:left}.partial{background:#ffe0e0}"
       ".oversub{background:#ffe8cc}.verdict{font-size:110%;font-weight:bold;padding:.6em;"
       "background:#eef4ff;border-left:4px solid #4c72b0}")


#: The page, one Jinja template: autoescaping on, so every text from the runs (a config or
#: job name like ``<script>``, a hostname, a note) is shown as text, never read as markup.
HTML_TEMPLATE = """\
<!DOCTYPE html><html><head><meta charset='utf-8'><title>{{ title }}</title>
<style>{{ css }}</style></head><body><h1>{{ title }}</h1>
{% for s in secs %}
<h2>{{ s.title }}</h2>
  {% if s.bullets %}
<ul>{% for t in s.text %}<li>{{ t }}</li>{% endfor %}</ul>
  {% else %}
    {% for t in s.text %}
<p{{ " class='verdict'"|safe if s.title == "Verdict" }}>{{ t }}</p>
    {% endfor %}
  {% endif %}
  {% if s.table %}
<div class='box'><table><tr>{% for h in s.table[0] %}<th>{{ h }}</th>{% endfor %}</tr>
    {% for row in s.table[1] %}
<tr{{ row_class(row) }}>{% for c in row %}<td{{ cell_class(c) }}>{{ c }}</td>{% endfor %}</tr>
    {% endfor %}
</table></div>
  {% endif %}
  {% if s.images %}
<div class='plots'>
    {% for alt, path in s.images %}
<figure><img alt='{{ alt }}' src='data:image/png;base64,{{ png(path) }}'></figure>
    {% endfor %}
</div>
  {% endif %}
{% endfor %}
</body></html>
"""


def _row_class(row: Sequence[str]) -> Markup:
    """The highlight of a table row: incomplete runs, then oversubscribed points."""
    return Markup(" class='partial'" if "PARTIAL" in row else
                  " class='oversub'" if any("OVERSUBSCRIBED" in c or "BUSY HOST" in c
                                            for c in row) else "")


def _cell_class(cell: str) -> Markup:
    """The highlight of a flagged number (outside its meaningful range)."""
    return Markup(" class='flag'" if FLAG in cell else "")


def _png(path: str | os.PathLike) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


_PAGE = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True,
                           keep_trailing_newline=True).from_string(HTML_TEMPLATE)


def render_html(secs: Sequence[Section], title: str) -> str:
    """Render report sections as a self-contained HTML page (images inlined as base64).

    Args:
        secs: The sections, in order.
        title: The page title.

    Returns:
        The HTML text.
    """
    return _PAGE.render(secs=secs, title=title, css=Markup(CSS), row_class=_row_class,
                        cell_class=_cell_class, png=_png)


def write_report(paths: Sequence[str | os.PathLike], out: str | os.PathLike,
                 mode: str | None = None, warmup: int | None = None,
                 title: str = "hpcpar scaling report", strict: bool = False,
                 threshold: float = 0.7,
                 predict_point: Callable[[dict, tuple], dict] | None = None,
                 predicted_by: str = "prediction") -> Report:
    """Load runs and write a scaling report: what ``hpcpar report`` does.

    Writes into ``out``: ``scaling.csv``, ``runs.csv``, speedup / efficiency / breakdown /
    throughput / imbalance PNGs, ``report.md`` and ``report.html`` (plots embedded).

    Args:
        paths: Run or sweep directories, at any depth.
        out: The report directory (created).
        mode: ``"strong"`` or ``"weak"`` scaling; detected from the runs when None.
        warmup: Steps dropped at the start of every run segment; the runs' own setting, else
            a tenth of the steps (at least one), when None.
        title: Title of the report.
        strict: Refuse runs of one config with different settings (else: own rows).
        threshold: The efficiency the verdict calls acceptable.
        predict_point: ``(job dict, grid) -> predicted seconds per step`` (see
            ``hpcpar.analysis.predicted``): adds predicted.csv, predicted.png and a
            "Predicted vs measured" section.
        predicted_by: What predicted (shown in the plot and section).

    Returns:
        The report: tables, headline and the paths of the files written.

    Raises:
        RunDirError: No readable run among ``paths``, no run with a step to report (each
            one's notes say why), or ``out`` cannot be written.
        ConfigError: ``strict`` and runs of one config with different settings.
        ValueError: An unknown ``mode``.

    Example:
        ```python
        rep = write_report(["runs/demo-sweep"], "runs/demo-sweep/report")
        print(rep.headline, rep.files["report.html"])
        ```
    """
    out = Path(out)
    skipped: list = []
    runs, steps = load(paths, skipped)
    runs = split_unlike(runs, strict)
    before = set(out.iterdir()) if out.is_dir() else None
    try:
        return _write(out, paths, runs, steps, skipped, mode, warmup, title, threshold,
                      predict_point, predicted_by)
    except OSError as exc:  # disk full, permissions, OUT is a file: one line naming it
        where = exc.filename or out
        tail = "; the files it had written are removed" if _remove_new(out, before) else ""
        raise RunDirError(f"{where}: cannot write the report ({exc.strerror or exc}){tail}") \
            from None


def _remove_new(out: Path, before: set | None) -> bool:
    """Take back what a failed report wrote, so no half report is left looking complete:
    the files that were not in ``out`` before (and ``out`` itself when it was made). Returns
    whether there was any."""
    removed = False
    try:
        for path in set(out.iterdir()) - (before or set()):
            if path.is_file() and not path.is_symlink():
                path.unlink()
                removed = True
        if before is None:
            out.rmdir()
    except OSError:
        pass    # a directory that cannot be listed or emptied: nothing more to do
    return removed


def _write(out: Path, paths, runs, steps, skipped, mode, warmup, title, threshold,
           predict_point=None, predicted_by="prediction") -> Report:
    table = scaling_table(runs, steps, mode=mode, warmup=warmup)
    if not table["t_step_median"].notna().any():  # nothing to plot or compare: say why
        more = f" (and {len(table) - 1} more point(s))" if len(table) > 1 else ""
        first = table.iloc[0]
        raise RunDirError(f"no step to report: {first['config']} @ {first['ranks']} ranks: "
                          f"{first['note'] or 'no usable steps'}{more}")
    warnings = [w for w in (version_warning(runs), *superlinear_warnings(table)) if w]
    out.mkdir(parents=True, exist_ok=True)
    kept = stats.drop_warmup(steps, runs, warmup) if len(steps) else steps
    files = {"scaling.csv": out / "scaling.csv", "runs.csv": out / "runs.csv"}
    table.to_csv(files["scaling.csv"], index=False)
    runs.drop(columns=["settings"]).to_csv(files["runs.csv"], index=False)
    images = _write_plots(out, table, runs, kept)
    learn = learning.learning_table(runs)
    files["learning.csv"] = out / "learning.csv"
    learn.to_csv(files["learning.csv"], index=False)
    curves = learning.learning_curves(runs)
    drawn = {key: (alt, plots.loss_curves_plot(curves, kind, title, out / name))
             for kind, key, alt, title, name in LEARNING_PLOTS
             if (curves["curve"] == kind).any()}
    secs = _sections(table, runs, images, paths, mode, warmup, skipped, threshold, warnings,
                     _learning_section(learn, list(drawn.values())))
    if predict_point is not None:
        pred = predicted_vs_measured(table, runs, predict_point)
        files["predicted.csv"] = out / "predicted.csv"
        pred.to_csv(files["predicted.csv"], index=False)
        images["predicted"] = plots.predicted_plot(pred, predicted_by, out / "predicted.png")
        images["predicted ratio"] = plots.predicted_ratio_plot(pred,
                                                               out / "predicted-ratio.png")
        secs.insert(-3, Section("Predicted vs measured", [
            f"Seconds per step: measured (median step time; phases: mean over ranks) beside "
            f"{predicted_by}; ratio = measured / predicted."], rows_of(pred, PREDICTED),
            images=[(k, images[k]) for k in ("predicted", "predicted ratio")]))
    stamp = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    files["report.md"] = out / "report.md"
    files["report.md"].write_text(render_markdown(secs, title) + f"\n_Generated {stamp}._\n")
    files["report.html"] = out / "report.html"
    files["report.html"].write_text(render_html(secs, title))
    files.update(images)
    files.update({key: path for key, (_, path) in drawn.items()})
    return Report(out, table, runs, files, headline_table(table), skipped,
                  verdict(table, threshold), warnings, learning.learning_verdict(learn), learn)
