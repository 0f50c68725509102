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
    RunDirError,
)
from hpcpar.formats import rundir
from hpcpar.run.checkpoint.resume import check_chosen, check_compatible, grid_change
from hpcpar.run.checkpoint.store import checkpoint_step, list_checkpoints, read_manifest, set_aside
from hpcpar.run.data_identity import check_same_data

__all__ = ["default_run_dir", "nothing_left", "decide", "prepare", "segments", "settle_settings",
           "outcome"]

#: suffix of the checkpoints newer than the one ``--from`` resumed: kept, never resumed
SUPERSEDED_SUFFIX = ".superseded"

Say = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_run_dir(job) -> str:
    """``[output] dir``, else ``runs/<job name>``: stable, so the same command again resumes."""
    return job.output.dir or os.path.join("runs", job.name)


def _is_grid(change: tuple) -> bool:
    """A ``[grid]`` setting: free to change between segments (a checkpoint resumes on any
    grid, :mod:`hpcpar.run.checkpoint`)."""
    return change[0].startswith("grid.")


def grid_report(run_dir: Path, shape, start_from: Path | None = None) -> str | None:
    """The one line a rerun on another grid prints: ``resuming step N of grid A on grid B``
    from ``start_from`` or the newest readable checkpoint (the ranks skip a corrupt one and
    the closing line names the one they took); None when it was written on this grid."""
    paths = [start_from] if start_from is not None else list_checkpoints(run_dir / "checkpoints")
    for path in paths:
        try:
            change = grid_change(check_compatible(path, shape), shape)
        except (OSError, ValueError):
            continue   # an unreadable manifest: the ranks check it
        return None if change is None else f"hpcpar: {change}"
    return (f"hpcpar: grid {'x'.join(map(str, shape))}: no checkpoint in {run_dir} to resume, "
            f"starting at step 0")


def check_from(rd: Path, job, grid_spec: str, start_from: Path | None, fresh: bool) -> None:
    """``--from CHECKPOINT``: it must verify and fit the job and grid
    (:func:`hpcpar.run.checkpoint.resume.check_chosen`), and ``--fresh`` would move it aside when it
    is one of the run directory's own."""
    if start_from is None:
        return
    shape = tuple(int(v) for v in grid_spec.split("x"))
    check_chosen(start_from, shape, job.model.kind)
    if fresh and start_from.resolve().is_relative_to(rd.resolve()):
        raise RunDirError(f"--from {start_from} with --fresh: --fresh moves the run "
                          f"directory's checkpoints aside, this one included; copy it out "
                          f"first, or drop --fresh")


def nothing_left(path: Path, step: int, total: int, field: str) -> str | None:
    """The one line refusing a resume from checkpoint ``path`` at ``step`` that leaves none
    of the job's ``total`` steps to train (``field``: where the count comes from); None when
    some remain. A run ending there would report the checkpoint's training as its own."""
    if step < total:
        return None
    where = "past" if step > total else "at"
    return (f"{path}: checkpoint of step {step}, {where} the job's last step {total} "
            f"({field}): nothing to train; ask for more steps, or resume from an earlier "
            f"checkpoint (--from)")


def _readable(path: Path) -> bool:
    """Whether the ranks could resume checkpoint ``path`` as far as its manifest tells: a
    directory merely named after a later step (its manifest disagrees) is set aside by them,
    not resumed, so it must not decide what is left to train."""
    try:
        read_manifest(path)
    except RunDirError:
        return False
    return True


def _check_steps_left(rd: Path, job, start_from: Path | None, changed: bool) -> None:
    """A checkpoint at or past ``[train] steps`` (with ``--from``, or a resume with changed
    settings, which no step would use) or past it (any resume) is refused before anything
    changes; with ``[train] epochs`` the ranks check it (:class:`hpcpar.run.trainer.Trainer`)."""
    total = job.train.steps
    if total is None:
        return
    if start_from is not None:
        path, exact = start_from, True
    else:
        newest = next((p for p in list_checkpoints(rd / "checkpoints") if _readable(p)), None)
        if newest is None:
            return
        path, exact = newest, changed
    step = checkpoint_step(path)
    if step is not None and (step > total or exact):
        line = nothing_left(path, step, int(total), f"[train] steps = {total}")
        if line is not None:
            raise RunDirError(line)


def decide(rd: Path, job, grid_spec: str, fresh: bool, new_settings: bool,
           start_from: Path | None = None) -> tuple:
    """Read-only: what to do with run directory ``rd``: ("run", diff), ("finished", message);
    raises a one-line error (nothing in ``rd`` changed) when the rerun is refused. With
    ``start_from`` (``--from``) a finished run runs again from that checkpoint."""
    check_from(rd, job, grid_spec, start_from, fresh)
    if start_from is not None:
        _check_steps_left(rd, job, start_from, True)
    if rd.exists() and not rd.is_dir():
        raise RunDirError(f"--run-dir {rd}: exists and is not a directory")
    if rd.is_symlink() and not rd.exists():
        raise RunDirError(f"--run-dir {rd}: a symbolic link to nothing (dangling or a loop)")
    if not rd.is_dir():
        return "run", []
    rundir.check_run_dir(rd)
    rundir.RunLock(rd).check()
    if fresh:
        rundir.check_fresh(rd, job.source)
        return "run", []
    diff = rundir.check_settings(rd, job.to_dict())
    settings = [c for c in diff if not _is_grid(c)]
    if settings and not new_settings:
        raise RunDirError(f"{rd}: settings differ from the run in this directory (job.json): "
                          f"{rundir.describe_diff(settings)}; run with the same settings to "
                          f"resume (--grid may change), --new-settings to continue with these, "
                          f"--fresh to start over (old files moved aside), or another --run-dir")
    meta = rundir.finished_status(rd) if start_from is None else None
    if meta is not None and not settings:
        steps = (meta.get("job") or {}).get("train", {}).get("steps")
        return "finished", (f"hpcpar: {rd}: already finished (status ok"
                            + (f", {steps} steps" if steps else "") + "); nothing to do "
                            "(--fresh starts over)")
    if not new_settings:
        check_same_data(rd, job)
    if start_from is None:
        _check_steps_left(rd, job, None, bool(settings))
    return "run", diff


def prepare(rd: Path, job, job_file: str, diff: list, fresh: bool, say: Say = _stderr,
            start_from: Path | None = None) -> tuple[Path, Path | None]:
    """With the lock held: move old files aside (--fresh; else an earlier result,
    :func:`hpcpar.formats.rundir.set_aside_result`), set aside the checkpoints a ``--from`` run
    supersedes, and write the job the ranks read. With changed settings (--new-settings) that
    is ``job.next.json``: it replaces job.json only once the ranks have started
    (:func:`settle_settings`). Returns the job's path and where the earlier result went."""
    aside = None
    if fresh:
        moved = rundir.move_aside(rd, keep=[job_file])
        if moved is not None:
            say(f"hpcpar: --fresh: moved the previous run's files to {moved}")
    else:
        aside = rundir.set_aside_result(rd)
    if start_from is not None:
        kept = supersede(rd / "checkpoints", start_from)
        if kept:
            say(f"hpcpar: --from {start_from}: the run's later checkpoints are kept as "
                f"{', '.join(kept)} (never resumed)")
    if any(_is_grid(c) for c in diff):
        line = grid_report(rd, tuple(job.grid_shape), start_from)
        if line is not None:
            say(line)
    settings = [c for c in diff if not _is_grid(c)]
    if settings:   # a grid change alone is the new job.json at once: nothing to keep
        say(f"hpcpar: --new-settings: continuing with {rundir.describe_diff(settings)}")
        path = rd / "job.next.json"
        path.write_text(job.to_json())
        return path, aside
    path = rd / "job.json"
    text = job.to_json()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    copy_job_file(rd, job_file)
    return path, aside


def supersede(ckpt_dir: Path, start_from: Path) -> list[str]:
    """Rename aside (``step-N.superseded``) the checkpoints of ``ckpt_dir`` at or after the
    step of ``start_from`` (other than itself): a run continued from an older checkpoint makes
    them another history, which a later plain resume must not pick up as the newest. Returns
    the new names."""
    step = checkpoint_step(start_from)
    assert step is not None, f"{start_from}: not a checkpoint directory"
    kept = []
    for path in list_checkpoints(ckpt_dir):  # each has a step
        if (checkpoint_step(path) or 0) >= step and path.resolve() != start_from.resolve():
            kept.append(set_aside(path, SUPERSEDED_SUFFIX).name)
    return kept


def copy_job_file(rd: Path, job_file: str) -> None:
    """RUN/job.toml: the job file as given (a different earlier copy is kept, renamed)."""
    src, copy = Path(job_file), rd / "job.toml"
    if src.resolve() == copy.resolve() or (copy.exists() and copy.read_bytes() == src.read_bytes()):
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
                    say: Say = _stderr, aside: Path | None = None) -> None:
    """After the ranks: if they started a segment, the earlier result stays ``aside``
    (:func:`prepare`) and new settings (--new-settings) become job.json (the old one kept as
    job-<time>.json, beside that result); if they refused to start, the directory is left as
    it was."""
    if aside is not None:
        if started:
            say(f"hpcpar: the previous result (metrics.json) is kept in {aside}")
        else:
            os.replace(aside, rd / "metrics.json")
    if job_path.name != "job.next.json" or not job_path.exists():
        return
    if started:
        kept = rundir.keep_old_settings(rd, aside)
        os.replace(job_path, rd / "job.json")
        copy_job_file(rd, job_file)
        if kept is not None:
            say(f"hpcpar: previous settings kept in {kept}")
    else:
        job_path.unlink()


def outcome(rd: Path, rc: int, started: bool, oom: str | None = None,
            say: Say = _stderr) -> int:
    """Say one closing line per outcome and mark how the run ended; returns the exit code of
    ``hpcpar run`` (documented codes only: a rank killed by a signal is 1, like any crash,
    unless its memory cgroup counted an out-of-memory kill: ``oom`` is then the line to print,
    exit code 6). ``started``: the ranks began a segment (else meta.json is a previous run's
    and is left alone)."""
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
        say(f"hpcpar: interrupted twice: the ranks were stopped without a checkpoint; run the "
            f"same command again to resume from the newest one in {rd / 'checkpoints'}")
    elif oom is not None and rc not in (EXIT_USAGE, EXIT_DIVERGED):
        if started:
            rundir.mark_ended(rd, "out of memory")
        say(f"hpcpar: error: {oom}; logs in {rd / 'logs'}")
        rc = EXIT_OUT_OF_MEMORY
    elif rc not in (EXIT_USAGE, EXIT_DIVERGED):
        if started:
            rundir.mark_ended(rd, f"ranks failed (launcher exit code {rc})")
        say(f"hpcpar: error: the ranks failed (launcher exit code {rc}); logs in {rd / 'logs'}")
        rc = EXIT_FAILED
    elif started:   # the ranks record their error; a rank killed meanwhile may not have
        rundir.mark_ended(rd, f"the ranks exited with code {rc}; see their error line in "
                              f"{rd / 'logs'}")
    return rc
