"""``hpcpar report RUN_OR_SWEEP_DIRS... -o OUT``: scaling tables, plots, Markdown and HTML."""

from __future__ import annotations

import click


def print_report(rep) -> None:
    """The headline table, the notes of partial rows, and where the report is."""
    click.echo(rep.headline)
    for r in rep.table.to_dict("records"):
        if r["partial"]:
            click.echo(f"PARTIAL {r['config']} @ {r['ranks']} ranks: {r['note']}")
    click.echo(f"report: {rep.files['report.html']}  (also report.md, scaling.csv, *.png in "
               f"{rep.out})")


@click.command("report")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--out", type=click.Path(file_okay=False), default="report",
              show_default=True, help="Directory for scaling.csv, report.md/html and plots.")
@click.option("--mode", type=click.Choice(["auto", "strong", "weak"]), default="auto",
              show_default=True, help="Strong or weak scaling; auto reads it from the runs "
              "(global batch constant -> strong, growing with ranks -> weak).")
@click.option("--warmup", type=click.IntRange(min=0), default=None,
              help="Steps dropped at the start of each run segment [default: the run's "
                   "timing_warmup meta, else max(1, steps/10)].")
@click.option("--title", default="hpcpar scaling report", show_default=True)
def report(paths, out, mode, warmup, title):
    """Scaling report of run or sweep directories (any depth below each path)."""
    from hpcpar.analysis.render import write_report

    rep = write_report(paths, out, mode=None if mode == "auto" else mode, warmup=warmup,
                       title=title)
    print_report(rep)
