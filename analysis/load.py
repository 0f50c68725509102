"""Reading run and sweep directories into two pandas DataFrames (runs and steps).

A path is a run directory (it holds ``meta.json``) or a folder holding run directories at any
depth (a sweep: ``DIR/ranks-N/``). Unreadable or foreign records raise one-line
:class:`~hpcpar.run.records.RecordsError`; a run that crashed, lost a rank or is still running is
loaded and marked ``partial`` with a ``note`` saying why, and only its steps that every rank
recorded are kept (a step time is a maximum over ranks: a missing rank would make it wrong).
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from hpcpar.run.records import COLUMN_NAMES, RecordsError, read_meta, read_steps

#: Columns of the run table (one row per run directory).
RUN_COLUMNS = ("run", "name", "config", "job_name", "ranks", "nodes", "grid_spec",
               "spatial_size", "global_batch", "problem_size", "timing_warmup", "status",
               "start_time", "end_time", "segment_starts", "hostnames", "slurm_job_id",
               "git_commit", "torch", "mpi_library", "steps_recorded", "steps_complete",
               "partial", "note")


def find_runs(paths) -> list[Path]:
    """Run directories named by ``paths`` (runs themselves, or folders searched for them)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    runs: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise RecordsError(f"{p}: no such file or directory")
        found = []
        for where, dirs, files in os.walk(p):
            if "meta.json" in files:  # a run: not searched further (previous-*/ set aside)
                found.append(Path(where))
                dirs.clear()
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.sort()
        if not found:
            raise RecordsError(f"{p}: no hpcpar run records (no meta.json in it or below)")
        runs += [r for r in found if r not in runs]
    return runs


def _spatial_size(meta: dict) -> int:
    grid = meta.get("grid") or {}
    return int(grid.get("x", 1)) * int(grid.get("y", 1)) * int(grid.get("z", 1))


def _completeness(steps: pd.DataFrame, ranks: int) -> tuple[pd.DataFrame, list[str]]:
    """Keep steps recorded by all ``ranks``; say which ranks are missing or stopped early."""
    notes = []
    present = set(steps["rank"].unique())
    missing = sorted(set(range(ranks)) - present)
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        notes.append(f"no records from rank(s) {shown}")
    last = steps.groupby("rank")["step"].max()
    if len(last) and last.min() < last.max():
        short = last[last < last.max()]
        notes.append(f"rank {short.index[0]} stopped at step {short.iloc[0]} "
                     f"(others reached {last.max()})")
    counts = steps.groupby("step")["rank"].transform("nunique")
    kept = steps[counts == ranks] if not missing else steps.iloc[0:0]
    return kept, notes


def load_run(run_dir) -> tuple[dict, pd.DataFrame]:
    """(run facts, complete steps) of one run directory; see the module docstring."""
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    ranks = int(meta.get("ranks") or 0)
    notes = []
    status = meta.get("status", "?")
    if status != "ok":
        why = {"running": "crashed or still running", "preempted": "preempted before the end",
               "failed": "the run failed"}.get(status, "unknown status")
        notes.append(f"status {status!r} ({why})")
    try:
        steps = read_steps(run_dir)
    except RecordsError as exc:
        if "no step records" not in str(exc):
            raise
        steps = pd.DataFrame({c: pd.Series(dtype="float64") for c in COLUMN_NAMES})
    recorded = int(steps["step"].nunique())
    if recorded == 0:
        notes.append("no step records")
    kept, more = _completeness(steps, ranks)
    notes += more
    dropped = recorded - int(kept["step"].nunique())
    if recorded and dropped:
        notes.append(f"{dropped} step(s) not recorded by every rank ignored")
    slurm = meta.get("slurm") or {}
    versions = meta.get("versions") or {}
    facts = {
        "run": str(run_dir), "name": run_dir.name,
        "config": str(meta.get("config") or meta.get("job_name") or "run"),
        "job_name": meta.get("job_name"), "ranks": ranks, "nodes": meta.get("nodes"),
        "grid_spec": meta.get("grid_spec"), "spatial_size": _spatial_size(meta),
        "global_batch": meta.get("global_batch"), "problem_size": meta.get("problem_size"),
        "timing_warmup": meta.get("timing_warmup"), "status": status,
        "start_time": meta.get("start_time"), "end_time": meta.get("end_time"),
        "segment_starts": [s.get("first_step") for s in meta.get("segments") or []
                           if s.get("first_step") is not None],
        "hostnames": ",".join(meta.get("hostnames") or []), "slurm_job_id": slurm.get("job_id"),
        "git_commit": (meta.get("git") or {}).get("commit"), "torch": versions.get("torch"),
        "mpi_library": versions.get("mpi_library"), "steps_recorded": recorded,
        "steps_complete": int(kept["step"].nunique()), "partial": bool(notes),
        "note": "; ".join(notes),
    }
    kept = kept.assign(run=facts["run"], config=facts["config"], ranks=ranks)
    return facts, kept.reset_index(drop=True)


def load(paths) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(runs, steps)`` of run or sweep directories.

    ``runs``: one row per run (:data:`RUN_COLUMNS`); ``steps``: the step records of every run
    (schema columns of :mod:`hpcpar.run.records` plus ``run``, ``config``, ``ranks``), only steps
    that every rank of the run recorded. Warm-up steps are still in; see
    :func:`hpcpar.analysis.drop_warmup`.
    """
    facts, frames = [], []
    for run in find_runs(paths):
        f, s = load_run(run)
        facts.append(f)
        frames.append(s)
    runs = pd.DataFrame(facts, columns=list(RUN_COLUMNS))
    steps = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return runs, steps
