"""``hpcpar run JOB.toml``: validate the job, pick the run directory, start the ranks.

No torch import here: validation errors come back in well under a second."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import click

from hpcpar.cli._options import json_option, ranks_option, set_option
from hpcpar.errors import EXIT_OK, EXIT_REQUEUE
from hpcpar.parallel.agree import agree
from hpcpar.parallel.grid import AXES, parse_spec

__all__ = ["run"]


def _grid_overrides(spec: str) -> list[str]:
    return [f"grid.{a}={v}" for a, v in zip(AXES, parse_spec(spec))]


@click.command()
@click.argument("job_file", metavar="JOB.toml")
@ranks_option(many=False, help="Number of ranks (default: the grid's product, the MPI world "
              "or the Slurm allocation's tasks, [resources]).")
@click.option("--grid", "grid_spec", metavar="DxXxYxZ", default=None,
              help="Override [grid], e.g. 2x2x1x1 (data x X x Y x Z; -1 infers one axis).")
@click.option("--run-dir", default=None, help="Run directory (default: [output] dir, else "
                                              "runs/<job name>).")
@set_option()
@click.option("--fresh", "--no-resume", "fresh", is_flag=True,
              help="Start over: move hpcpar's files of the run directory into previous-<time>/ "
                   "(nothing is deleted, other files stay). Default: continue from the newest "
                   "valid checkpoint.")
@click.option("--resume", "_resume", is_flag=True,
              help="Continue from the newest valid checkpoint (the default; kept for scripts).")
@click.option("--from", "start_from", metavar="CHECKPOINT_DIR", default=None,
              help="Continue from this checkpoint (a step-N directory of this run or another) "
                   "instead of the newest; this run's later checkpoints are kept aside as "
                   "step-N.superseded.")
@click.option("--new-settings", is_flag=True,
              help="Continue the run in the directory with settings that differ from its "
                   "job.json (a new segment; the old job.json is kept).")
@click.option("--dry-run", is_flag=True,
              help="Validate and print the launch command and the threads per rank only.")
@click.option("--print-config", is_flag=True,
              help="Print the fully resolved job (every default filled in, the grid resolved "
                   "for the rank count) as TOML, a job file `hpcpar run` accepts; run nothing.")
@json_option("With --print-config or --dry-run: print JSON instead.")
def run(job_file, ranks, grid_spec, run_dir, sets, fresh, _resume, start_from, new_settings,
        dry_run, print_config, as_json):
    """Run a training job: mpiexec locally, srun inside a Slurm allocation, in-process when already
    under MPI. Exit codes: 0 done (or already finished), 1 failed (crash or a rank died), 2 user
    error, 3 checkpointed after SIGUSR1/SIGTERM/Ctrl-C (run again to resume), 4 diverged (non-finite
    loss or gradient), 6 a rank was killed by the memory limit, 130 interrupted twice. The run
    directory is printed on stdout (`RUN=$(hpcpar run job.toml)`), progress on stderr."""
    from hpcpar.formats.jobspec import load_job  # deferred: keeps --help fast
    from hpcpar.launch.launcher import (  # deferred: keeps --help fast
        default_ranks,
        launch_command,
        mpi_world_size,
        plan_launch,
        rank_argv,
    )
    from hpcpar.launch.threads import threads_per_rank  # deferred: keeps --help fast
    from hpcpar.run import rerun  # deferred: keeps --help fast

    overrides = list(sets)
    if grid_spec is not None:
        overrides += _grid_overrides(grid_spec)
    job = load_job(job_file, overrides)
    n = ranks or default_ranks() or job.fixed_ranks() or 1
    shape = job.check_ranks(n)
    overrides += [f"grid.{a}={v}" for a, v in zip(("data", "x", "y", "z"), shape)]
    job = load_job(job_file, overrides)
    if print_config:
        from hpcpar.formats.jobschema import job_to_toml  # deferred: keeps --help fast

        click.echo(json.dumps(job.to_dict(), indent=1) if as_json else job_to_toml(job), nl=as_json)
        return
    spec = "x".join(map(str, shape))
    mode = plan_launch(n)
    threads = threads_per_rank(job.resources.cpus_per_task)
    world = mpi_world_size()
    comm = None
    rd = Path(os.path.expanduser(run_dir or rerun.default_run_dir(job)))  # ~ once, here
    if mode == "direct" and world > 1:    # every rank runs this command: rank 0 decides
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    lead = comm is None or comm.Get_rank() == 0
    for note in job.notes if lead else ():
        click.echo(f"hpcpar: note: {note}", err=True)
    start_from = Path(start_from).absolute() if start_from else None

    def say(line: str) -> None:
        click.echo(line, err=True)

    def command(job_path: Path):
        argv = rank_argv(str(job_path), str(rd), resume=not fresh)
        argv += ["--from", str(start_from)] if start_from is not None else []
        return argv, launch_command(mode, n, argv, cpus_per_task=job.resources.cpus_per_task,
                                    gpus_per_node=job.resources.gpus_per_node)

    what, detail = agree(comm, lambda: rerun.decide(rd, job, spec, fresh, new_settings,
                                                    start_from), root=0)
    if dry_run:
        cmd = command(rd / "job.json")[1]
        if as_json:
            click.echo(json.dumps({"run_dir": str(rd), "ranks": n, "grid": spec, "mode": mode,
                                   "threads_per_rank": threads, "command": cmd}))
        else:
            click.echo(f"run dir: {rd}\nranks: {n} (grid {spec}, {mode})\nthreads per rank: "
                       f"{threads} (OMP_NUM_THREADS, torch)\ncommand: {shlex.join(cmd)}")
        return
    if what == "finished":
        if lead:
            click.echo(detail, err=True)
            click.echo(str(rd))
        return
    from hpcpar.formats.rundir import RunLock, make_run_dir  # deferred: keeps --help fast

    lock = RunLock(rd, warn=lambda m: click.echo(m, err=True))
    try:
        job_path, aside = agree(comm, lambda: (
            make_run_dir(rd), lock.acquire(), rerun.prepare(rd, job, job_file, detail, fresh,
                                                            say, start_from))[2], root=0)
        if lead:
            click.echo(f"hpcpar: {job.name}: {n} rank(s), grid {spec}, run dir {rd}", err=True)
        argv, cmd = command(job_path)
        before = rerun.segments(rd)
        from hpcpar.launch.oom import OomWatch  # deferred: keeps --help fast

        watch = OomWatch()
        rc = _launch(mode, cmd, argv, threads, lock, world)
        started = rerun.segments(rd) > before
        if lead:
            rerun.settle_settings(rd, job_path, job_file, started, say, aside)
            if rc in (None, EXIT_OK, EXIT_REQUEUE):    # a run to read or to resume
                click.echo(str(rd))
        if rc is not None:
            rc = rerun.outcome(rd, rc, started, watch.message(n, spec), say)
            lock.release()
            sys.exit(rc)
    finally:
        lock.release()


def _launch(mode, cmd, argv, threads, lock, world=1) -> int | None:
    """Start the ranks, each with ``threads`` compute threads, in this process or launched
    alike; the launcher's exit code (None: ran in-process and finished). A single rank under
    a memory limit (a cgroup's) runs as a child process, so that a kill by the limit can be
    reported instead of killing this command too, and so does one that gets an allocator
    this process does not have (:mod:`hpcpar.launch.allocator`)."""
    from hpcpar.launch.allocator import preload  # deferred: keeps --help fast
    from hpcpar.launch.launcher import run_ranks  # deferred: keeps --help fast
    from hpcpar.launch.mpiexec import rank_env  # deferred: keeps --help fast
    from hpcpar.launch.oom import memory_limit  # deferred: keeps --help fast
    from hpcpar.launch.threads import thread_env, use_threads  # deferred: keeps --help fast

    if mode == "direct" and (world > 1 or (memory_limit() is None
                                           and not preload(dict(os.environ)))):
        from hpcpar.run.trainer import main as rank_main  # deferred: keeps --help fast

        use_threads(threads)
        rank_main(argv[3:], on_exit=lock.release)
        return None
    extra = thread_env(threads)
    if sys.stderr.isatty():
        extra["HPCPAR_PROGRESS"] = "1"
    return run_ranks(cmd, rank_env(extra))


