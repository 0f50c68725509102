"""``hpcpar submit`` (render + sbatch a sweep) and ``hpcpar status`` (its jobs' states)."""

from __future__ import annotations

import json
import shlex

import click

from hpcpar.cli._options import (
    complete_site,
    json_option,
    node_counts,
    out_option,
    ranks_option,
    set_option,
)

__all__ = ["submit", "status"]


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@out_option("Sweep directory: runs in OUT/ranks-N/, scripts+logs in OUT/slurm/.",
            required=True)
@click.option("--site", default="generic", show_default=True, shell_complete=complete_site,
              help="Site profile name (see slurm/sites) or path to a .toml profile.")
@ranks_option(many=True, help="Rank counts to run, e.g. 1,2,4.")
@click.option("--nodes", callback=node_counts, metavar="N[,N...]",
              help="Node counts (ranks = nodes x ranks per node), e.g. 1,2,4.")
@click.option("--ranks-per-node", type=click.IntRange(1), metavar="N",
              help="Ranks per node (default: the job's [resources] tasks_per_node, else the "
                   "site's).")
@click.option("--array", is_flag=True, help="One job array over the sweep points.")
@click.option("--weak", is_flag=True,
              help="Weak scaling: global batch grows with the ranks (as hpcpar sweep).")
@click.option("--after", multiple=True, metavar="JOBID",
              help="Start after JOBID succeeded (afterok); TYPE:JOBID passes through.")
@click.option("--report", is_flag=True,
              help="Add a job (afterany) running `hpcpar report` into OUT/report.")
@click.option("--dry-run", is_flag=True, help="Print the scripts; submit nothing.")
@click.option("--time", "time_", metavar="TIME", help="Time limit, e.g. 01:30:00.")
@click.option("--grace", type=click.IntRange(0), metavar="SECONDS",
              help="Checkpoint signal this long before the time limit (0: none).")
@click.option("--max-requeues", type=click.IntRange(0), metavar="N",
              help="Requeue a checkpointed job at most N times (default: the site's).")
@set_option("Override a job field (passed on to `hpcpar run`).")
@json_option("One JSON object per submitted job (id, label, kind, ranks, run_dir).")
def submit(job_file, out, site, ranks, nodes, ranks_per_node, array, weak, after, report, dry_run,
           time_, grace, max_requeues, sets, as_json):
    """Render sbatch scripts for JOB_FILE from a site profile and submit them."""
    from hpcpar.launch.submit import dry_run_text, plan_submit  # deferred: keeps --help fast
    from hpcpar.launch.submit import submit as do_submit  # deferred: keeps --help fast

    jobs = plan_submit(job_file, out, site=site, ranks=ranks, nodes=nodes, array=array,
                       after=after, report=report, time=time_, sets=sets, grace=grace,
                       max_requeues=max_requeues, weak=weak, ranks_per_node=ranks_per_node)
    if dry_run:
        click.echo(dry_run_text(jobs), nl=False)
        return
    for rec in do_submit(jobs, out):
        if as_json:
            click.echo(json.dumps(rec, default=str))
            continue
        what = f"{rec['ranks']} ranks" if rec["kind"] == "run" else "report"
        click.echo(f"{rec['id']}\t{rec['label']}\t{what}\t{rec['run_dir']}")
    follow = shlex.join(["hpcpar", "status", str(out)])  # safe to copy into a shell
    click.echo(f"hpcpar: submitted; follow with `{follow}`", err=True)


@click.command()
@click.argument("sweep_dir", type=click.Path(file_okay=False))
@json_option("One JSON object per job.")
def status(sweep_dir, as_json):
    """State of each Slurm job recorded in SWEEP_DIR (by `hpcpar submit`)."""
    from hpcpar.launch.submit import format_status, sweep_status  # deferred: keeps --help fast

    rows = sweep_status(sweep_dir)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
    else:
        click.echo(format_status(rows))
