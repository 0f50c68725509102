"""``hpcpar run JOB.toml``: validate the job, pick the run directory, start the ranks.

No torch import here: validation errors come back in well under a second.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import click


def _grid_overrides(spec: str) -> list[str]:
    from hpcpar.parallel.grid import AXES, parse_spec

    return [f"grid.{a}={v}" for a, v in zip(AXES, parse_spec(spec))]


def default_run_dir(job) -> str:
    if job.output.dir:
        return job.output.dir
    return os.path.join("runs", f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _check_resume(run_dir: Path, grid_spec: str) -> str | None:
    """Fail early (one line) when the checkpoints to resume were written by another grid."""
    from hpcpar.run.checkpoint import MANIFEST, list_checkpoints
    from hpcpar.errors import HpcparError

    for path in list_checkpoints(run_dir / "checkpoints"):
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            continue   # the ranks skip it with a warning
        if manifest.get("grid") != grid_spec:
            raise HpcparError(f"{run_dir}: its checkpoints were written by grid "
                              f"{manifest.get('grid')}, this run is grid {grid_spec}: use the "
                              f"same grid, another --run-dir, or --no-resume")
        return path.name
    return None


def _set_aside(run_dir: Path) -> None:
    """--no-resume in a used run directory: move the previous run's files into previous-<ts>/."""
    old = [p for p in ("checkpoints", "records", "logs", "meta.json", "metrics.json",
                       "steps.parquet", "steps.csv") if (run_dir / p).exists()]
    if not old:
        return
    dest = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir()
    for p in old:
        shutil.move(str(run_dir / p), str(dest / p))
    click.echo(f"hpcpar: --no-resume: moved the previous run's files to {dest}", err=True)


@click.command()
@click.argument("job_file", metavar="JOB.toml")
@click.option("-n", "--ranks", type=click.IntRange(min=1), default=None,
              help="Number of ranks (default: the grid's product, the MPI world or the Slurm "
                   "allocation's tasks, [resources]).")
@click.option("--grid", "grid_spec", metavar="DxXxYxZ", default=None,
              help="Override [grid], e.g. 2x2x1x1 (data x X x Y x Z; -1 infers one axis).")
@click.option("--run-dir", default=None, help="Run directory (default: [output] dir, else "
                                              "runs/<job>-<timestamp>).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override any job field, e.g. --set train.lr=0.01 (repeatable).")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue from the newest valid checkpoint in the run directory.")
@click.option("--dry-run", is_flag=True, help="Validate and print the launch command only.")
def run(job_file, ranks, grid_spec, run_dir, overrides, resume, dry_run):
    """Run a training job: mpiexec locally, srun inside a Slurm allocation, in-process when
    already under MPI. Exit codes: 0 done, 1 failed, 2 user error, 3 checkpointed after
    SIGUSR1/SIGTERM (requeue to resume)."""
    from hpcpar.run.jobspec import load_job
    from hpcpar.launch.launcher import (default_ranks, launch_command, mpi_world_size, plan_launch,
                          rank_argv, run_ranks)
    from hpcpar.launch.mpiexec import rank_env

    overrides = list(overrides)
    if grid_spec is not None:
        overrides += _grid_overrides(grid_spec)
    job = load_job(job_file, overrides)
    n = ranks or default_ranks() or job.fixed_ranks() or 1
    shape = job.check_ranks(n)
    overrides += [f"grid.{a}={v}" for a, v in zip(("data", "x", "y", "z"), shape)]
    job = load_job(job_file, overrides)
    mode = plan_launch(n)
    world = mpi_world_size()
    rd = Path(run_dir or default_run_dir(job))
    if mode == "direct" and world > 1:    # every rank runs this command: agree on the dir
        from mpi4py import MPI

        rd = Path(MPI.COMM_WORLD.bcast(str(rd), root=0))
        lead = MPI.COMM_WORLD.Get_rank() == 0
    else:
        lead = True
    job_json = rd / "job.json"
    argv = rank_argv(str(job_json), str(rd), resume)
    cmd = launch_command(mode, n, argv, cpus_per_task=job.resources.cpus_per_task,
                         gpus_per_node=job.resources.gpus_per_node)
    if rd.exists() and not rd.is_dir():
        raise click.UsageError(f"--run-dir {rd}: exists and is not a directory")
    resume_from = _check_resume(rd, "x".join(map(str, shape))) if resume else None
    if dry_run:
        click.echo(f"run dir: {rd}\nranks: {n} (grid {'x'.join(map(str, shape))}, {mode})\n"
                   f"command: {shlex.join(cmd)}")
        return
    if lead:
        rd.mkdir(parents=True, exist_ok=True)
        if not resume:
            _set_aside(rd)
        job_json.write_text(job.to_json())
        src = Path(job_file)
        if src.resolve() != (rd / "job.toml").resolve():
            shutil.copyfile(src, rd / "job.toml")
        click.echo(f"hpcpar: {job.name}: {n} rank(s), grid {'x'.join(map(str, shape))}, "
                   f"run dir {rd}" + (f", resuming from {resume_from}" if resume_from else ""),
                   err=True)
    if mode == "direct":
        if world > 1:
            from mpi4py import MPI

            MPI.COMM_WORLD.Barrier()
        from hpcpar.run.trainer import main as rank_main

        rank_main(argv[3:])
        return
    extra = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                               str(job.resources.cpus_per_task))}
    if sys.stderr.isatty():
        extra["HPCPAR_PROGRESS"] = "1"
    rc = run_ranks(cmd, rank_env(extra))
    _report(rd, rc)


def _report(rd: Path, rc: int) -> None:
    from hpcpar.run.signals import EXIT_FAILED, EXIT_OK, EXIT_REQUEUE, EXIT_USAGE

    if rc == EXIT_OK:
        try:
            loss = json.loads((rd / "metrics.json").read_text()).get("final_train_loss")
        except (OSError, ValueError):
            loss = None
        tail = f", final train loss {loss:.5g}" if isinstance(loss, float) else ""
        click.echo(f"hpcpar: done: {rd} (metrics.json, steps records){tail}", err=True)
        return
    if rc == EXIT_REQUEUE:
        click.echo(f"hpcpar: stopped by signal after checkpointing in {rd / 'checkpoints'}; "
                   f"run the same command again (or requeue) to resume", err=True)
    elif rc != EXIT_USAGE:
        click.echo(f"hpcpar: error: the ranks failed (exit code {rc}); logs in {rd / 'logs'}",
                   err=True)
    sys.exit(rc if rc in (EXIT_USAGE, EXIT_REQUEUE) else (rc or EXIT_FAILED))
