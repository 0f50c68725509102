"""What rerunning a job in a run directory does, decided before any rank starts: run, resume,
continue with new settings, or say it is finished (:func:`decide`, read-only); move old files
aside and write the job the ranks read (:func:`prepare`); make new settings the run's once the
ranks started (:func:`settle_settings`); and how the run ended (:func:`outcome`). The CLI only
parses options and prints; this is the policy, so it is the same for every caller.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hpcpar.errors import (
    EXIT_ABORTED,
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_REQUEUE,
    EXIT_USAGE,
    HpcparError,
    RunDirError,
)
from hpcpar.run import rundir
from hpcpar.run.checkpoint import check_compatible, list_checkpoints

__all__ = ["default_run_dir", "check_grid", "decide", "prepare", "copy_job_file", "segments",
           "settle_settings", "agreed", "outcome"]

Say = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_run_dir(job) -> str:
    """``[output] dir``, else ``runs/<job name>``: stable, so running the same command again
    resumes."""
    if job.output.dir:
        return job.output.dir
    return os.path.join("runs", job.name)


def check_grid(run_dir: Path, grid_spec: str) -> None:
    """Fail early (one line) when the newest readable checkpoint cannot resume on this grid
    (the rule is :func:`hpcpar.run.checkpoint.check_compatible`'s)."""
    shape = tuple(int(v) for v in grid_spec.split("x"))
    for path in list_checkpoints(run_dir / "checkpoints"):
        try:
            check_compatible(path, shape)
        except (OSError, ValueError):
            continue   # an unreadable manifest: the ranks check it
        return


def decide(rd: Path, job, grid_spec: str, fresh: bool, new_settings: bool) -> tuple:
    """Read-only: what to do with run directory ``rd``: ("run", diff), ("finished", message);
    raises a one-line error (nothing in ``rd`` changed) when the rerun is refused."""
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
        check_grid(rd, grid_spec)
    meta = rundir.finished_status(rd)
    if meta is not None and not diff:
        steps = (meta.get("job") or {}).get("train", {}).get("steps")
        return "finished", (f"hpcpar: {rd}: already finished (status ok"
                            + (f", {steps} steps" if steps else "") + "); nothing to do "
                            "(--fresh starts over)")
    return "run", diff


def prepare(rd: Path, job, job_file: str, diff: list, fresh: bool, say: Say = _stderr) -> Path:
    """With the lock held: move old files aside (--fresh) and write the job the ranks read,
    returned. With changed settings (--new-settings) that is ``job.next.json``: it replaces
    job.json only once the ranks have started (:func:`settle_settings`)."""
    if fresh:
        moved = rundir.move_aside(rd, keep=[job_file])
        if moved is not None:
            say(f"hpcpar: --fresh: moved the previous run's files to {moved}")
    if diff:
        say(f"hpcpar: --new-settings: continuing with {rundir.describe_diff(diff)}")
        path = rd / "job.next.json"
        path.write_text(job.to_json())
        return path
    path = rd / "job.json"
    text = job.to_json()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    copy_job_file(rd, job_file)
    return path


def copy_job_file(rd: Path, job_file: str) -> None:
    """RUN/job.toml: the job file as given (a different earlier copy is kept, renamed)."""
    src, copy = Path(job_file), rd / "job.toml"
    if src.resolve() == copy.resolve() or (copy.exists()
                                           and copy.read_bytes() == src.read_bytes()):
        return
    if copy.exists():
        copy.replace(rd / f"job-{time.strftime('%Y%m%d-%H%M%S')}.toml")
    shutil.copyfile(src, copy)


def segments(rd: Path) -> int:
    try:
        return len(json.loads((rd / "meta.json").read_text()).get("segments", []))
    except (OSError, ValueError, AttributeError):
        return 0


def settle_settings(rd: Path, job_path: Path, job_file: str, started: bool,
                    say: Say = _stderr) -> None:
    """After the ranks of a --new-settings run: if they started a segment, the new settings
    become job.json (the old one kept as job-<time>.json); if they refused to start, the
    directory is left as it was."""
    if job_path.name != "job.next.json" or not job_path.exists():
        return
    if started:
        kept = rundir.keep_old_settings(rd)
        os.replace(job_path, rd / "job.json")
        copy_job_file(rd, job_file)
        if kept is not None:
            say(f"hpcpar: previous settings kept in {kept}")
    else:
        job_path.unlink()


def agreed(comm, action):
    """Run ``action`` on rank 0 only (all ranks when not under MPI) and give every rank its
    result, or raise its error on every rank alike."""
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


def outcome(rd: Path, rc: int, started: bool, oom: str | None = None,
            say: Say = _stderr) -> int:
    """Say one closing line per outcome and mark how the run ended; returns the exit code of
    ``hpcpar run`` (documented codes only:
    a rank killed by a signal is 1, like any crash, unless its memory cgroup counted an
    out-of-memory kill: ``oom`` is then the line to print, exit code 6). ``started``: the ranks
    began a segment (else meta.json is a previous run's and is left alone)."""
    resumed = rundir.resumed_from(rd) if started else None
    if resumed is not None:
        say(f"hpcpar: the ranks resumed from {resumed[0]} (step {resumed[1]})")
    if rc == EXIT_OK:
        try:
            loss = json.loads((rd / "metrics.json").read_text()).get("final_train_loss")
        except (OSError, ValueError):
            loss = None
        tail = f", final train loss {loss:.5g}" if isinstance(loss, float) else ""
        say(f"hpcpar: done: {rd} (metrics.json, steps records){tail}")
        return rc
    if rc == EXIT_REQUEUE:
        if started:
            rundir.mark_ended(rd, "stopped by a signal (exit code 3)", status="preempted")
        say(f"hpcpar: stopped by signal after checkpointing in {rd / 'checkpoints'}; "
                   f"run the same command again (or requeue) to resume")
    elif rc == EXIT_ABORTED:
        if started:
            rundir.mark_ended(rd, "interrupted")
        say(f"hpcpar: interrupted twice: the ranks were stopped without a checkpoint; "
                   f"run the same command again to resume from the newest one in "
                   f"{rd / 'checkpoints'}")
    elif oom is not None and rc not in (EXIT_USAGE, EXIT_DIVERGED):
        if started:
            rundir.mark_ended(rd, "out of memory")
        say(f"hpcpar: error: {oom}; logs in {rd / 'logs'}")
        rc = EXIT_OUT_OF_MEMORY
    elif rc not in (EXIT_USAGE, EXIT_DIVERGED):
        if started:
            rundir.mark_ended(rd, f"ranks failed (launcher exit code {rc})")
        say(f"hpcpar: error: the ranks failed (launcher exit code {rc}); logs in "
                   f"{rd / 'logs'}")
        rc = EXIT_FAILED
    elif started:   # the ranks record their error; a rank killed meanwhile may not have
        rundir.mark_ended(rd, f"the ranks exited with code {rc}; see their error line in "
                              f"{rd / 'logs'}")
    return rc
