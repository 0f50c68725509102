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

from hpcpar.cli._options import json_option, ranks_option, set_option

__all__ = ["default_run_dir", "run"]


def _grid_overrides(spec: str) -> list[str]:
    from hpcpar.parallel.grid import AXES, parse_spec

    return [f"grid.{a}={v}" for a, v in zip(AXES, parse_spec(spec))]


def default_run_dir(job) -> str:
    """``[output] dir``, else ``runs/<job name>``: stable, so running the same command again
    resumes."""
    if job.output.dir:
        return job.output.dir
    return os.path.join("runs", job.name)


def _check_grid(run_dir: Path, grid_spec: str) -> None:
    """Fail early (one line) when the newest readable checkpoint cannot resume on this grid
    (the rule is :func:`hpcpar.run.checkpoint.check_compatible`'s)."""
    from hpcpar.run.checkpoint import check_compatible, list_checkpoints

    shape = tuple(int(v) for v in grid_spec.split("x"))
    for path in list_checkpoints(run_dir / "checkpoints"):
        try:
            check_compatible(path, shape)
        except (OSError, ValueError):
            continue   # an unreadable manifest: the ranks check it
        return


def _decide(rd: Path, job, grid_spec: str, fresh: bool, new_settings: bool) -> tuple:
    """Read-only: what to do with run directory ``rd``: ("run", diff), ("finished", message);
    raises a one-line error (nothing in ``rd`` changed) when the rerun is refused."""
    from hpcpar.errors import RunDirError
    from hpcpar.run import rundir

    if rd.exists() and not rd.is_dir():
        raise RunDirError(f"--run-dir {rd}: exists and is not a directory")
    if rd.is_symlink() and not rd.exists():
        raise RunDirError(f"--run-dir {rd}: a symbolic link to nothing (dangling or a loop)")
    if not rd.is_dir():
        return "run", []
    rundir.RunLock(rd).check()
    rundir.check_run_dir(rd)
    if fresh:
        return "run", []
    diff = rundir.check_settings(rd, job.to_dict())
    if diff and not new_settings:
        raise RunDirError(f"{rd}: settings differ from the run in this directory (job.json): "
                          f"{rundir.describe_diff(diff)}; run with the same settings to resume, "
                          f"--new-settings to continue with these, --fresh to start over (old "
                          f"files moved aside), or another --run-dir")
    if not any(k.startswith("grid.") for k, _, _ in diff):
        _check_grid(rd, grid_spec)
    meta = rundir.finished_status(rd)
    if meta is not None and not diff:
        steps = (meta.get("job") or {}).get("train", {}).get("steps")
        return "finished", (f"hpcpar: {rd}: already finished (status ok"
                            + (f", {steps} steps" if steps else "") + "); nothing to do "
                            "(--fresh starts over)")
    return "run", diff


def _prepare(rd: Path, job, job_file: str, diff: list, fresh: bool) -> Path:
    """With the lock held: move old files aside (--fresh) and write the job the ranks read,
    returned. With changed settings (--new-settings) that is ``job.next.json``: it replaces
    job.json only once the ranks have started (:func:`_settle_settings`)."""
    from hpcpar.run import rundir

    if fresh:
        moved = rundir.move_aside(rd, keep=[job_file])
        if moved is not None:
            click.echo(f"hpcpar: --fresh: moved the previous run's files to {moved}", err=True)
    if diff:
        click.echo(f"hpcpar: --new-settings: continuing with {rundir.describe_diff(diff)}",
                   err=True)
        path = rd / "job.next.json"
        path.write_text(job.to_json())
        return path
    path = rd / "job.json"
    text = job.to_json()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    _copy_job_file(rd, job_file)
    return path


def _copy_job_file(rd: Path, job_file: str) -> None:
    """RUN/job.toml: the job file as given (a different earlier copy is kept, renamed)."""
    src, copy = Path(job_file), rd / "job.toml"
    if src.resolve() == copy.resolve() or (copy.exists()
                                           and copy.read_bytes() == src.read_bytes()):
        return
    if copy.exists():
        copy.replace(rd / f"job-{time.strftime('%Y%m%d-%H%M%S')}.toml")
    shutil.copyfile(src, copy)


def _segments(rd: Path) -> int:
    try:
        return len(json.loads((rd / "meta.json").read_text()).get("segments", []))
    except (OSError, ValueError, AttributeError):
        return 0


def _settle_settings(rd: Path, job_path: Path, job_file: str, started: bool) -> None:
    """After the ranks of a --new-settings run: if they started a segment, the new settings
    become job.json (the old one kept as job-<time>.json); if they refused to start, the
    directory is left as it was."""
    from hpcpar.run import rundir

    if job_path.name != "job.next.json" or not job_path.exists():
        return
    if started:
        kept = rundir.keep_old_settings(rd)
        os.replace(job_path, rd / "job.json")
        _copy_job_file(rd, job_file)
        if kept is not None:
            click.echo(f"hpcpar: previous settings kept in {kept}", err=True)
    else:
        job_path.unlink()


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
@click.option("--new-settings", is_flag=True,
              help="Continue the run in the directory with settings that differ from its "
                   "job.json (a new segment; the old job.json is kept).")
@click.option("--dry-run", is_flag=True, help="Validate and print the launch command only.")
@click.option("--print-config", is_flag=True,
              help="Print the fully resolved job (every default filled in, the grid resolved "
                   "for the rank count) as TOML, a job file `hpcpar run` accepts; run nothing.")
@json_option("With --print-config or --dry-run: print JSON instead.")
def run(job_file, ranks, grid_spec, run_dir, sets, fresh, _resume, new_settings,
        dry_run, print_config, as_json):
    """Run a training job: mpiexec locally, srun inside a Slurm allocation, in-process when
    already under MPI. Exit codes: 0 done (or already finished), 1 failed (crash or a rank
    died), 2 user error, 3 checkpointed after SIGUSR1/SIGTERM/Ctrl-C (run again to resume),
    4 diverged (non-finite loss or gradient), 6 a rank was killed by the memory limit,
    130 interrupted twice. The run directory is
    printed on stdout (`RUN=$(hpcpar run job.toml)`), progress on stderr."""
    from hpcpar.errors import EXIT_OK, EXIT_REQUEUE
    from hpcpar.formats.jobspec import load_job
    from hpcpar.launch.launcher import (
        default_ranks,
        launch_command,
        mpi_world_size,
        plan_launch,
        rank_argv,
    )

    overrides = list(sets)
    if grid_spec is not None:
        overrides += _grid_overrides(grid_spec)
    job = load_job(job_file, overrides)
    n = ranks or default_ranks() or job.fixed_ranks() or 1
    shape = job.check_ranks(n)
    overrides += [f"grid.{a}={v}" for a, v in zip(("data", "x", "y", "z"), shape)]
    job = load_job(job_file, overrides)
    if print_config:
        from hpcpar.formats.jobschema import job_to_toml

        click.echo(json.dumps(job.to_dict(), indent=1) if as_json else job_to_toml(job),
                   nl=as_json)
        return
    spec = "x".join(map(str, shape))
    mode = plan_launch(n)
    world = mpi_world_size()
    comm = None
    rd = Path(run_dir or default_run_dir(job))
    if mode == "direct" and world > 1:    # every rank runs this command: rank 0 decides
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    lead = comm is None or comm.Get_rank() == 0

    def command(job_path: Path):
        argv = rank_argv(str(job_path), str(rd), resume=not fresh)
        return argv, launch_command(mode, n, argv, cpus_per_task=job.resources.cpus_per_task,
                                    gpus_per_node=job.resources.gpus_per_node)

    what, detail = _agreed(comm, lambda: _decide(rd, job, spec, fresh, new_settings))
    if dry_run:
        cmd = command(rd / "job.json")[1]
        if as_json:
            click.echo(json.dumps({"run_dir": str(rd), "ranks": n, "grid": spec, "mode": mode,
                                   "command": cmd}))
        else:
            click.echo(f"run dir: {rd}\nranks: {n} (grid {spec}, {mode})\n"
                       f"command: {shlex.join(cmd)}")
        return
    if what == "finished":
        if lead:
            click.echo(detail, err=True)
            click.echo(str(rd))
        return
    from hpcpar.run.rundir import RunLock

    lock = RunLock(rd, warn=lambda m: click.echo(m, err=True))
    try:
        if lead:
            rd.mkdir(parents=True, exist_ok=True)
        job_path = _agreed(comm, lambda: (lock.acquire(),
                                          _prepare(rd, job, job_file, detail, fresh))[1])
        if lead:
            click.echo(f"hpcpar: {job.name}: {n} rank(s), grid {spec}, run dir {rd}", err=True)
        argv, cmd = command(job_path)
        before = _segments(rd)
        from hpcpar.launch.oom import OomWatch

        watch = OomWatch()
        rc = _launch(mode, cmd, argv, job, lock, world)
        started = _segments(rd) > before
        if lead:
            _settle_settings(rd, job_path, job_file, started)
            if rc in (None, EXIT_OK, EXIT_REQUEUE):    # a run to read or to resume
                click.echo(str(rd))
        if rc is not None:
            _report(rd, rc, lock, started, watch.message(n, spec))
    finally:
        lock.release()


def _agreed(comm, action):
    """Run ``action`` on rank 0 only (all ranks when not under MPI) and give every rank its
    result, or raise its error on every rank alike."""
    from hpcpar.errors import HpcparError

    if comm is None:
        return action()
    out = None
    if comm.Get_rank() == 0:
        try:
            out = ("ok", action())
        except HpcparError as exc:
            out = ("error", exc)
    out = comm.bcast(out, root=0)
    if out[0] == "error":
        raise out[1]
    return out[1]


def _launch(mode, cmd, argv, job, lock, world=1) -> int | None:
    """Start the ranks; the launcher's exit code (None: ran in-process and finished). A
    single rank under a memory limit (a cgroup's) runs as a child process, so that a kill by
    the limit can be reported instead of killing this command too."""
    from hpcpar.launch.launcher import run_ranks
    from hpcpar.launch.mpiexec import rank_env
    from hpcpar.launch.oom import memory_limit

    if mode == "direct" and (world > 1 or memory_limit() is None):
        from hpcpar.run.trainer import main as rank_main

        rank_main(argv[3:], on_exit=lock.release)
        return None
    extra = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                               str(job.resources.cpus_per_task))}
    if sys.stderr.isatty():
        extra["HPCPAR_PROGRESS"] = "1"
    return run_ranks(cmd, rank_env(extra))


def _report(rd: Path, rc: int, lock, started: bool, oom: str | None = None) -> None:
    """One closing line per outcome; the exit code of ``hpcpar run`` (documented codes only:
    a rank killed by a signal is 1, like any crash, unless its memory cgroup counted an
    out-of-memory kill: ``oom`` is then the line to print, exit code 6). ``started``: the ranks
    began a segment (else meta.json is a previous run's and is left alone)."""
    from hpcpar.errors import (
        EXIT_ABORTED,
        EXIT_DIVERGED,
        EXIT_FAILED,
        EXIT_OK,
        EXIT_OUT_OF_MEMORY,
        EXIT_REQUEUE,
        EXIT_USAGE,
    )
    from hpcpar.run import rundir

    resumed = rundir.resumed_from(rd) if started else None
    if resumed is not None:
        click.echo(f"hpcpar: the ranks resumed from {resumed[0]} (step {resumed[1]})", err=True)
    if rc == EXIT_OK:
        try:
            loss = json.loads((rd / "metrics.json").read_text()).get("final_train_loss")
        except (OSError, ValueError):
            loss = None
        tail = f", final train loss {loss:.5g}" if isinstance(loss, float) else ""
        click.echo(f"hpcpar: done: {rd} (metrics.json, steps records){tail}", err=True)
        return
    if rc == EXIT_REQUEUE:
        if started:
            rundir.mark_ended(rd, "stopped by a signal (exit code 3)", status="preempted")
        click.echo(f"hpcpar: stopped by signal after checkpointing in {rd / 'checkpoints'}; "
                   f"run the same command again (or requeue) to resume", err=True)
    elif rc == EXIT_ABORTED:
        if started:
            rundir.mark_ended(rd, "interrupted")
        click.echo(f"hpcpar: interrupted twice: the ranks were stopped without a checkpoint; "
                   f"run the same command again to resume from the newest one in "
                   f"{rd / 'checkpoints'}", err=True)
    elif oom is not None and rc not in (EXIT_USAGE, EXIT_DIVERGED):
        if started:
            rundir.mark_ended(rd, "out of memory")
        click.echo(f"hpcpar: error: {oom}; logs in {rd / 'logs'}", err=True)
        rc = EXIT_OUT_OF_MEMORY
    elif rc not in (EXIT_USAGE, EXIT_DIVERGED):
        if started:
            rundir.mark_ended(rd, f"ranks failed (launcher exit code {rc})")
        click.echo(f"hpcpar: error: the ranks failed (launcher exit code {rc}); logs in "
                   f"{rd / 'logs'}", err=True)
        rc = EXIT_FAILED
    elif started:   # the ranks record their error; a rank killed meanwhile may not have
        rundir.mark_ended(rd, f"the ranks exited with code {rc}; see their error line in "
                              f"{rd / 'logs'}")
    lock.release()
    sys.exit(rc)
