"""``hpcpar sweep JOB.toml --ranks 1,2,4 --out DIR``: a scaling study on this machine.

Each rank count N runs ``hpcpar run JOB -n N --grid G --run-dir DIR/ranks-N`` in turn, then ``hpcpar
report`` writes DIR/report/. The grid of a point, ``--weak`` batches and the threads per rank follow
:mod:`hpcpar.launch.sweep`. ``--submit`` hands the whole sweep to ``hpcpar submit`` (Slurm)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click

from hpcpar.cli._options import json_option, out_option, ranks_option, set_option
from hpcpar.errors import LaunchError
from hpcpar.launch.sweep import plan, run_command, run_points, submit_command, sweep_lock

__all__ = ["sweep"]


@click.command("sweep")
@click.argument("job", type=click.Path(dir_okay=False))
@ranks_option(many=True, required=True, help="Rank counts, e.g. 1,2,4.")
@out_option("Sweep directory: OUT/ranks-N/ per point, OUT/report/ at the end.",
            required=True)
@click.option("--weak", is_flag=True, help="Weak scaling: global batch grows with the ranks.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Threads per rank at every point (also [resources] cpus_per_task) "
                   "[default: OMP_NUM_THREADS, else the job's cpus_per_task; the same at "
                   "every point].")
@click.option("--submit", is_flag=True, help="Submit the points and the report to Slurm "
              "(hpcpar submit) instead of running here.")
@set_option("Override a job field at every point (repeatable).")
@click.option("--warmup", type=click.IntRange(min=0), default=None,
              help="Steps the report drops at the start of each run [default: max(1, n/10)].")
@click.option("--resume", is_flag=True, help="Continue interrupted points from their "
              "checkpoints instead of starting each point afresh.")
@click.option("-v", "--verbose", is_flag=True, help="Stream each run's output.")
@json_option("Print the report's summary as JSON (verdict, points, files) on stdout; "
             "progress goes to stderr.")
def sweep(job, ranks, out, weak, threads, submit, sets, warmup, resume, verbose, as_json):
    """Run JOB at each rank count, then write the scaling report into OUT/report/."""
    ranks = sorted(ranks)
    if threads is not None:
        sets = (*sets, f"resources.cpus_per_task={threads}")
    if submit:
        rc = subprocess.run(submit_command(job, out, ranks, weak, sets)).returncode
        sys.exit(rc)
    points = plan(job, ranks, weak, sets, threads)
    out = Path(out)
    with sweep_lock(out, warn=lambda m: click.echo(m, err=True)):
        (out / "sweep.json").write_text(json.dumps(
            {"job": str(job), "ranks": ranks, "weak": weak, "sets": list(sets),
             "points": [dict(p, command=run_command(job, p, out / f"ranks-{p['ranks']}", resume))
                        for p in points]}, indent=1) + "\n")
        failed = run_points(job, points, out, verbose, resume, say=click.echo,
                            warn=lambda m: click.echo(m, err=True))
        done = [out / f"ranks-{p['ranks']}" for p in points
                if (out / f"ranks-{p['ranks']}" / "meta.json").exists()]
        if not done:
            raise LaunchError(f"{out}: no point of the sweep left run records; see the logs there")
        from hpcpar.analysis.render import write_report  # deferred: loads pandas, matplotlib
        from hpcpar.cli.report import print_report  # deferred: keeps --help fast

        rep = write_report(done, out / "report", mode="weak" if weak else "strong", warmup=warmup,
                           title=f"hpcpar {'weak' if weak else 'strong'} scaling: {Path(job).name}")
        print_report(rep, as_json)
        if failed:
            raise LaunchError(f"sweep: point(s) {', '.join(map(str, failed))} failed; their rows "
                              f"are partial or missing (logs in {out})")
