"""``hpcpar report RUN_OR_SWEEP_DIRS... -o OUT``: scaling tables, plots, Markdown and HTML."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hpcpar.cli._options import json_option, out_option
from hpcpar.errors import EXIT_BELOW_REFERENCE, ConfigError

__all__ = ["print_report", "report"]


def report_json(rep) -> dict:
    """The report as one strict-JSON document: verdict, one object per (config, ranks) point
    (the scaling.csv row), the files written, the runs left out and the warnings."""
    from hpcpar.formats.records import strict_json  # deferred: keeps --help fast

    return strict_json({"verdict": rep.verdict, "learning": rep.learning, "out": str(rep.out),
                        "points": rep.table.to_dict("records"),
                        "files": {k: str(v) for k, v in rep.files.items()},
                        "skipped": list(rep.skipped), "warnings": list(rep.warnings)})


def print_report(rep, as_json: bool = False) -> None:
    """The headline table, the notes of partial rows, and where the report is; each run
    left out (unreadable meta.json) and each of the report's warnings (runs of different
    hpcpar versions) is one warning line on stderr. With ``as_json``, one JSON document
    instead (:func:`report_json`)."""
    for reason in rep.skipped:
        click.echo(f"hpcpar: warning: skipped run: {reason}", err=True)
    for warning in rep.warnings:
        click.echo(f"hpcpar: warning: {warning}", err=True)
    if as_json:
        click.echo(json.dumps(report_json(rep), allow_nan=False))
        return
    click.echo(rep.verdict)
    click.echo(rep.learning)
    click.echo(rep.headline)
    for r in rep.table.to_dict("records"):
        if r["partial"]:
            click.echo(f"PARTIAL {r['config']} @ {r['ranks']} ranks: {r['note']}")
        elif "settings differ" in r["note"]:
            click.echo(f"OWN ROW {r['config']} @ {r['ranks']} ranks: {r['note']}")
    click.echo(f"report: {rep.files['report.html']}  (also report.md, scaling.csv, *.png in "
               f"{rep.out})")


def _refuse_overwrite(out: Path, page: str, force: bool) -> None:
    """A report already in ``out`` is someone's result: replaced only with ``--force``."""
    if not force and (out / page).exists():
        raise ConfigError(f"{out}: holds a report already ({page}); use --force to replace "
                          f"it, or -o another directory")


def plan_predictor(machine_name: str, trust_kind: bool = False):
    """``(job dict, grid) -> predicted seconds per step`` from ``hpcpar plan``'s model of a
    machine (``slurm/machines/NAME.toml`` or a path); the job's workload is traced once. The
    job comes from a run directory: its ``[model] kind`` imports no code unless it is built in
    or ``trust_kind`` (installed packages only)."""
    from hpcpar.formats.jobspec import build_job  # deferred: keeps --help fast
    from hpcpar.plan.job import workload_of  # deferred: keeps --help fast
    from hpcpar.plan.machine import load_machine  # deferred: keeps --help fast
    from hpcpar.plan.planner import predict  # deferred: keeps --help fast

    machine = load_machine(machine_name)
    works: dict = {}

    def predict_point(job_dict: dict, grid: tuple) -> dict:
        key = json.dumps(job_dict, sort_keys=True, default=str)
        if key not in works:
            works[key] = workload_of(build_job(job_dict, source="meta.json job", untrusted=True,
                                               trust_kind=trust_kind))
        pred = predict(works[key], grid, machine)
        if not pred.feasible:
            raise ConfigError(f"grid {pred.spec}: {pred.reason}")
        return {"t_step": pred.t_step, "t_compute": pred.t_compute + pred.extra.get("t_opt", 0),
                "t_halo": pred.t_halo + pred.t_gather,
                "t_comm_exposed": pred.t_allreduce_exposed + pred.t_tp,
                "t_io": pred.extra.get("io_exposed", pred.t_io)}

    return predict_point


@click.command("report")
@click.argument("paths", nargs=-1, required=False, type=click.Path())
@out_option("Directory for scaling.csv, report.md/html and plots.", default="report")
@click.option("--mode", type=click.Choice(["auto", "strong", "weak"]), default="auto",
              show_default=True, help="Strong or weak scaling; auto reads it from the runs "
              "(global batch constant -> strong, growing with ranks -> weak).")
@click.option("--warmup", type=click.IntRange(min=0), default=None,
              help="Steps dropped at the start of each run segment [default: the run's "
                   "timing_warmup meta, else max(1, steps/10)].")
@click.option("--title", default="hpcpar scaling report", show_default=True)
@click.option("--strict", is_flag=True, help="Error (exit 2) when runs of one config differ "
              "in their job settings, instead of giving each its own row.")
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.7, show_default=True,
              help="Efficiency the verdict line calls acceptable.")
@click.option("--expect", "expect", type=click.Path(dir_okay=False), default=None,
              help="TOML references (per config and rank count: min_efficiency, "
                   "max_step_time, tolerance); exit 5 naming every point that falls short.")
@click.option("--plan", "plan_machine", default=None, metavar="MACHINE",
              help="Put hpcpar plan's predicted step time and phases for MACHINE (a name in "
                   "slurm/machines or a machine TOML) beside the measured ones.")
@click.option("--trust-kind", is_flag=True,
              help="With --plan: load a run's [model] kind that is not built in from an "
                   "installed package (never from the working directory).")
@click.option("--compare", "compare", nargs=2, type=click.Path(), default=None,
              metavar="BEFORE AFTER", help="Compare two sweeps (before/after a change): "
              "compare.csv/.md/.html/.png in OUT with the step-time ratio per point.")
@click.option("--force", is_flag=True, help="Replace a report already in OUT (without it, "
              "an existing report is never overwritten).")
@json_option("Print the report as one JSON document (verdict, one object per point, files).")
def report(paths, out, mode, warmup, title, strict, threshold, expect, plan_machine, compare,
           as_json, trust_kind, force):
    """Scaling report of run or sweep directories (any depth below each path)."""
    mode = None if mode == "auto" else mode
    _refuse_overwrite(Path(out), "compare.html" if compare else "report.html", force)
    refs = None
    if expect:
        from hpcpar.analysis.expect import read_expectations  # deferred: loads pandas, numpy

        refs = read_expectations(expect)  # a bad file fails before any work
    if compare:
        if paths:
            raise ConfigError("report --compare BEFORE AFTER takes no other paths")
        from hpcpar.analysis.compare import write_comparison  # deferred: loads pandas, matplotlib

        cmp, files = write_comparison(compare[0], compare[1], out, mode=mode, warmup=warmup,
                                      strict=strict)
        if as_json:
            from hpcpar.formats.records import strict_json  # deferred: keeps --help fast

            click.echo(json.dumps(strict_json({
                "verdict": cmp.attrs["verdict"], "points": cmp.to_dict("records"),
                "files": {k: str(v) for k, v in files.items()}}), allow_nan=False))
            return
        click.echo(cmp.attrs["verdict"])
        click.echo(cmp.attrs["headline"])
        click.echo(f"comparison: {files['compare.html']}  (also compare.md, compare.csv, "
                   f"compare.png in {out})")
        return
    if not paths:
        raise ConfigError("report: give run or sweep directories (or --compare BEFORE AFTER)")
    from hpcpar.analysis.render import write_report  # deferred: loads pandas, matplotlib

    predictor = plan_predictor(plan_machine, trust_kind) if plan_machine else None
    rep = write_report(paths, out, mode=mode, warmup=warmup, title=title, strict=strict,
                       threshold=threshold, predict_point=predictor,
                       predicted_by=f"hpcpar plan ({plan_machine})")
    print_report(rep, as_json)
    if refs is not None:
        from hpcpar.analysis.expect import check_expectations  # deferred: loads pandas, numpy

        short = check_expectations(rep.table, refs)
        for line in short:
            click.echo(f"BELOW REFERENCE {line}", err=True)
        if short:
            click.echo(f"hpcpar: error: {len(short)} point(s) below the references in "
                       f"{expect}", err=True)

            raise SystemExit(EXIT_BELOW_REFERENCE)
        click.echo(f"references met: {expect}", err=as_json)
