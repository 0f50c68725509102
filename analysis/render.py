"""The report: scaling.csv, runs.csv, PNG plots, report.md and a self-contained report.html.

Markdown and HTML are rendered from the same list of sections, so they always say the same.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from hpcpar.run.records import SCHEMA_VERSION

from . import plots, stats
from .load import load
from .scaling import scaling_table

#: Headline columns: (table column, header, format).
HEADLINE = (("config", "config", "{}"), ("ranks", "ranks", "{}"), ("grid", "grid", "{}"),
            ("t_step_median", "step time median (s)", "{:.4g}"),
            ("t_step_cv", "CV", "{:.3f}"), ("speedup", "speedup", "{:.3f}"),
            ("efficiency", "efficiency", "{:.3f}"), ("karp_flatt", "Karp-Flatt", "{:.4f}"),
            ("throughput", "samples/s", "{:.4g}"), ("partial", "partial", "{}"))
BREAKDOWN = (("config", "config", "{}"), ("ranks", "ranks", "{}"),
             *((f"frac_{p}", f"{plots.PHASE_LABELS[p]}", "{:.1%}") for p in stats.PHASES),
             ("imbalance", "imbalance max/mean", "{:.3f}"), ("steps", "steps", "{}"),
             ("runs", "runs", "{}"))
RUNS = (("name", "run", "{}"), ("ranks", "ranks", "{}"), ("grid_spec", "grid", "{}"),
        ("status", "status", "{}"), ("steps_complete", "steps", "{}"),
        ("start_time", "start", "{}"), ("hostnames", "hosts", "{}"),
        ("slurm_job_id", "Slurm job", "{}"), ("git_commit", "commit", "{:.10}"),
        ("torch", "torch", "{}"), ("mpi_library", "MPI", "{}"))

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
    "t_bwd + t_opt - t_halo; other = the rest. Imbalance = max_r / mean_r of compute time.",
]


@dataclass
class Section:
    title: str
    text: list = field(default_factory=list)      # paragraphs / bullet items
    table: tuple | None = None                     # (header list, rows of str)
    images: list = field(default_factory=list)     # (alt, Path)
    bullets: bool = False


@dataclass
class Report:
    out: Path
    table: pd.DataFrame
    runs: pd.DataFrame
    files: dict
    headline: str


def _cell(value, fmt: str) -> str:
    if isinstance(value, bool):
        return "PARTIAL" if value else ""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def rows_of(df: pd.DataFrame, spec) -> tuple[list, list]:
    header = [h for _, h, _ in spec]
    rows = [[_cell(r[c], f) for c, _, f in spec] for r in df.to_dict("records")]
    return header, rows


def markdown_table(header, rows) -> str:
    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)])


def headline_table(table: pd.DataFrame) -> str:
    """The headline table (Markdown pipe table, also readable in a terminal)."""
    return markdown_table(*rows_of(table, HEADLINE))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(text)).strip("-") or "config"


def _write_plots(out: Path, table, runs, steps) -> dict:
    files = {"speedup": plots.speedup_plot(table, out / "speedup.png"),
             "efficiency": plots.efficiency_plot(table, out / "efficiency.png"),
             "breakdown": plots.breakdown_plot(table, out / "breakdown.png"),
             "throughput": plots.throughput_plot(table, out / "throughput.png")}
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


def _sections(table, runs, files, paths, mode, warmup) -> list[Section]:
    notes = [f"{r['config']} @ {r['ranks']} ranks: {r['note']}"
             for r in table.to_dict("records") if r["note"]]
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
    secs = [Section("Scaling", intro, rows_of(table, HEADLINE))]
    if notes:
        secs.append(Section("Notes", notes, bullets=True))
    secs.append(Section("Plots", images=[(k, v) for k, v in files.items()]))
    secs.append(Section("Where the time goes", ["Share of rank time per phase."],
                        rows_of(table, BREAKDOWN)))
    secs.append(Section("Runs", [], rows_of(runs.sort_values(["config", "ranks"]), RUNS)))
    secs.append(Section("Definitions", DEFINITIONS, bullets=True))
    return secs


def render_markdown(secs, title) -> str:
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


CSS = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
       "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;"
       "padding:3px 7px;text-align:right}th{background:#f0f0f0}img{max-width:48%;margin:4px}"
       "td:first-child,th:first-child{text-align:left}.partial{background:#ffe0e0}")


def render_html(secs, title) -> str:
    esc = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{esc(title)}</h1>"]
    for s in secs:
        parts.append(f"<h2>{esc(s.title)}</h2>")
        if s.bullets:
            parts.append("<ul>" + "".join(f"<li>{esc(t)}</li>" for t in s.text) + "</ul>")
        else:
            parts += [f"<p>{esc(t)}</p>" for t in s.text]
        if s.table:
            header, rows = s.table
            parts.append("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>")
            for row in rows:
                cls = " class='partial'" if "PARTIAL" in row else ""
                parts.append(f"<tr{cls}>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>")
            parts.append("</table>")
        for alt, path in s.images:
            data = base64.b64encode(Path(path).read_bytes()).decode()
            parts.append(f"<img alt='{esc(alt)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(paths, out, mode: str | None = None, warmup=None,
                 title: str = "hpcpar scaling report") -> Report:
    """Load ``paths`` (run or sweep directories) and write the report into ``out``:
    scaling.csv, runs.csv, speedup/efficiency/breakdown/throughput/imbalance PNGs, report.md,
    report.html (plots embedded). Returns the table, the run table and the file paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs, steps = load(paths)
    table = scaling_table(runs, steps, mode=mode, warmup=warmup)
    kept = stats.drop_warmup(steps, runs, warmup) if len(steps) else steps
    files = {"scaling.csv": out / "scaling.csv", "runs.csv": out / "runs.csv"}
    table.to_csv(files["scaling.csv"], index=False)
    runs.to_csv(files["runs.csv"], index=False)
    images = _write_plots(out, table, runs, kept)
    secs = _sections(table, runs, images, paths, mode, warmup)
    stamp = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    files["report.md"] = out / "report.md"
    files["report.md"].write_text(render_markdown(secs, title) + f"\n_Generated {stamp}._\n")
    files["report.html"] = out / "report.html"
    files["report.html"].write_text(render_html(secs, title))
    files.update(images)
    return Report(out, table, runs, files, headline_table(table))
