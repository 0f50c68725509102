"""Reading run and sweep directories into two pandas DataFrames (runs and steps).

A path is a run directory (it holds ``meta.json``) or a folder holding run directories at any
depth (a sweep: ``DIR/ranks-N/``). A run whose meta.json is unreadable or foreign is skipped
with a one-line reason (:func:`load`); a run that crashed, lost a rank, is still running or
has damaged step records (missing or garbled rank files, a truncated steps.parquet) is loaded
and marked ``partial`` with a ``note`` saying why, and only its steps that every rank recorded
are kept (a step time is a maximum over ranks: a missing rank would make it wrong). Steps with
an impossible time (zero, negative, infinite) are left out the same way (``suspect``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from hpcpar.errors import RunDirError
from hpcpar.formats.records import COLUMN_NAMES, read_meta, read_steps

from .settings import resolved_settings, settings_hash
from .suspect import impossible_steps

__all__ = ["RUN_COLUMNS", "find_runs", "load_run", "load_run_parts", "load"]

#: Columns of the run table (one row per run directory).
RUN_COLUMNS = ("run", "name", "config", "job_name", "ranks", "nodes", "grid_spec",
               "spatial_size", "global_batch", "problem_size", "timing_warmup", "status",
               "start_time", "end_time", "segment_starts", "hostnames", "slurm_job_id",
               "git_commit", "hpcpar_version", "torch", "mpi_library", "steps_recorded",
               "steps_complete", "partial", "note", "cores_per_node", "ranks_per_node",
               "threads_per_rank", "oversubscribed", "settings_hash", "settings", "load_before",
               "load_after", "run_dir")


def find_runs(paths: Sequence[str | os.PathLike] | str | os.PathLike) -> list[Path]:
    """The run directories named by paths: runs themselves, or folders searched for them.

    Args:
        paths: Run directories, sweep directories or any folders holding runs.

    Returns:
        The run directories found.

    Raises:
        RunDirError: A path does not exist, or no run is found.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    runs: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise RunDirError(f"{p}: no such file or directory")
        found = []
        for where, dirs, files in os.walk(p):
            if "meta.json" in files:  # a run: not searched further (previous-*/ set aside)
                found.append(Path(where))
                dirs.clear()
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.sort()
        if not found:
            raise RunDirError(f"{p}: no hpcpar run records (no meta.json in it or below)")
        runs += [r for r in found if r not in runs]
    return runs


def _spatial_size(meta: dict) -> int:
    grid = meta.get("grid") or {}
    return int(grid.get("x", 1)) * int(grid.get("y", 1)) * int(grid.get("z", 1))


def _completeness(steps: pd.DataFrame, ranks: int) -> tuple[pd.DataFrame, list[str]]:
    """Keep steps recorded by all ``ranks``; say which ranks are missing or stopped early."""
    notes = []
    present = set(steps["rank"].unique())
    missing = [r for r in range(ranks) if r not in present]
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


#: The most ranks a run record may claim: every rank's records are checked, so a number
#: from a damaged meta.json must not make the report allocate or loop over billions of ranks.
MAX_RANKS = 1 << 20


def _ranks(meta: dict, path: Path) -> int:
    ranks = meta.get("ranks")
    if isinstance(ranks, bool) or not isinstance(ranks, (int, float)) or ranks < 1 \
            or ranks > MAX_RANKS or int(ranks) != ranks:
        raise RunDirError(f"{path}: field 'ranks' is {ranks!r}, expected a positive integer "
                          f"up to {MAX_RANKS}")
    return int(ranks)


def _optional_int(value):
    return None if value is None else int(value)


#: meta.json fields the run table takes as they are, and the JSON types they may hold
META_TYPES: dict[str, type | tuple[type, ...]] = {
    "config": str, "job_name": str, "nodes": int, "grid_spec": str,
    "global_batch": (int, float), "problem_size": (int, float), "status": str,
    "start_time": str, "end_time": str, "hostnames": list, "slurm": dict,
    "versions": dict, "machine": dict, "git": dict, "grid": dict, "segments": list,
    "host_load": dict}
JSON_NAMES: dict[type | tuple[type, ...], str] = {
    str: "string", int: "integer", (int, float): "number", list: "array", dict: "object"}


def _load1(meta: dict, when: str) -> float | None:
    """The host's 1-minute load average ``when`` ("before"/"after") the run; None unless
    recorded as a finite number >= 0."""
    values = (meta.get("host_load") or {}).get(when)
    v = values[0] if isinstance(values, list) and values else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"):
        return float(v)
    return None


def _check_types(meta: dict, path: Path) -> None:
    """A field of another JSON type is one line here, not a failure deep in pandas."""
    for key, types in META_TYPES.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise RunDirError(f"{path}: field {key!r} is {str(value)[:40]!r}, expected a JSON "
                              f"{JSON_NAMES[types]}")


def load_run(run_dir: str | os.PathLike) -> tuple[dict, pd.DataFrame]:
    """Load one run directory (the steps of its last segment's grid, when its segments ran
    on several: :func:`load_run_parts` gives each grid's).

    Damaged step records (a missing or unreadable rank file, garbage lines, a truncated
    steps.parquet) make the run partial, with notes in its facts.

    Args:
        run_dir: The run directory.

    Returns:
        ``(facts, steps)``: the run's row of the run table, and its complete steps.

    Raises:
        RunDirError: A meta.json that cannot be read or holds malformed fields (the run
            cannot be placed in a table).
    """
    return load_run_parts(run_dir)[-1]


def load_run_parts(run_dir: str | os.PathLike) -> list[tuple[dict, pd.DataFrame]]:
    """Load one run directory as one ``(facts, steps)`` per grid its segments ran on (a
    resume may change the grid): steps timed on one grid are never pooled with, or labelled
    as, another's. A run on one grid is one part, named as the run; each part of a run on
    several is ``RUN [grid G]`` with that grid's ranks, nodes and segment starts.

    Raises:
        RunDirError: As :func:`load_run`.
    """
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    try:
        return _load_run(run_dir, meta)
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise RunDirError(f"{run_dir / 'meta.json'}: malformed field ({exc})") from None


def _segment_grids(meta: dict) -> list[dict]:
    """The segments that recorded steps, each with its grid (``grid_spec``, ``ranks``,
    ``nodes``), in order; [] when some segment does not say its grid (records written before
    segments recorded it: the run's grid then stands for all of them)."""
    segs = [s for s in meta.get("segments") or [] if isinstance(s, dict)
            and s.get("first_step") is not None]
    if not all(isinstance(s.get("grid_spec"), str) for s in segs):
        return []
    return segs


def _grid_parts(meta: dict, steps: pd.DataFrame) -> list[tuple[dict, pd.DataFrame]]:
    """Split ``steps`` by the grid of the segment that recorded them (a later segment
    replaces the rows from its first step on, as the records' merge does): one
    ``(grid facts, steps)`` per grid, the grid of the run's last segment last; ``({}, steps)``
    for a run on one grid."""
    segs = _segment_grids(meta)
    specs = list(dict.fromkeys(s["grid_spec"] for s in segs))
    if len(specs) < 2:
        return [({}, steps)]
    owner = pd.Series(segs[0]["grid_spec"], index=steps.index, dtype=object)
    for seg in segs[1:]:
        owner[steps["step"] >= int(seg["first_step"])] = seg["grid_spec"]
    last = segs[-1]["grid_spec"]
    parts = []
    for spec in sorted(specs, key=lambda g: g == last):
        mine = [s for s in segs if s["grid_spec"] == spec]
        shape = [int(v) for v in spec.split("x")]
        parts.append(({"grid_spec": spec, "grid": dict(zip(("data", "x", "y", "z"), shape)),
                       "ranks": math.prod(shape), "nodes": mine[-1].get("nodes"),
                       "segment_starts": [int(s["first_step"]) for s in mine]},
                      steps[owner == spec]))
    return parts


def _load_run(run_dir: Path, meta: dict) -> list[tuple[dict, pd.DataFrame]]:
    _ranks(meta, run_dir / "meta.json")
    _check_types(meta, run_dir / "meta.json")
    notes = []
    status = meta.get("status", "?")
    if status != "ok":
        why = {"running": "crashed or still running", "preempted": "preempted before the end",
               "failed": "the run failed",
               "diverged": "non-finite loss or gradient"}.get(status, "unknown status")
        reason = (meta.get("diverged") or {}).get("reason") if status == "diverged" else None
        why += f": {reason}" if reason else ""
        notes.append(f"status {status!r} ({why})")
    try:
        steps = read_steps(run_dir, notes)
    except RunDirError as exc:
        steps = pd.DataFrame({c: pd.Series(dtype="float64") for c in COLUMN_NAMES})
        if "no step records" not in str(exc):
            notes.append(str(exc).replace(f"{run_dir}/", ""))
    return [_load_part(run_dir, meta, list(notes), grid, part)
            for grid, part in _grid_parts(meta, steps)]


def _load_part(run_dir: Path, meta: dict, notes: list, grid: dict,
               steps: pd.DataFrame) -> tuple[dict, pd.DataFrame]:
    """The run table row and complete steps of a run's steps on one grid (``grid``: that
    grid's facts when the run's segments ran on several, else {})."""
    ranks = _ranks({**meta, **grid}, run_dir / "meta.json")
    recorded = int(steps["step"].nunique())
    if recorded == 0:
        notes.append("no step records")
    kept, more = _completeness(steps, ranks)
    notes += more
    dropped = recorded - int(kept["step"].nunique())
    if recorded and dropped:
        notes.append(f"{dropped} step(s) not recorded by every rank ignored")
    kept, more = impossible_steps(kept)
    notes += more
    slurm = meta.get("slurm") or {}
    versions = meta.get("versions") or {}
    machine = meta.get("machine") or {}
    settings = resolved_settings(meta)
    label = f" [grid {grid['grid_spec']}]" if grid else ""
    starts = grid.get("segment_starts", [int(s["first_step"]) for s in meta.get("segments")
                                         or [] if s.get("first_step") is not None])
    status = meta.get("status", "?")
    facts = {
        "run": str(run_dir) + label, "name": run_dir.name + label,
        "config": str(meta.get("config") or meta.get("job_name") or "run"),
        "job_name": meta.get("job_name"), "ranks": ranks,
        "nodes": grid.get("nodes", meta.get("nodes")),
        "grid_spec": grid.get("grid_spec", meta.get("grid_spec")),
        "spatial_size": _spatial_size({**meta, **grid}),
        "global_batch": meta.get("global_batch"), "problem_size": meta.get("problem_size"),
        "timing_warmup": _optional_int(meta.get("timing_warmup")), "status": status,
        "start_time": meta.get("start_time"), "end_time": meta.get("end_time"),
        "segment_starts": starts,
        "hostnames": ",".join(meta.get("hostnames") or []), "slurm_job_id": slurm.get("job_id"),
        "git_commit": (meta.get("git") or {}).get("commit"),
        "hpcpar_version": versions.get("hpcpar"), "torch": versions.get("torch"),
        "mpi_library": versions.get("mpi_library"), "steps_recorded": recorded,
        "steps_complete": int(kept["step"].nunique()), "partial": bool(notes),
        "note": "; ".join(notes),
        **{k: _optional_int(machine.get(k)) for k in ("cores_per_node", "ranks_per_node",
                                                      "threads_per_rank")},
        "oversubscribed": machine.get("oversubscribed"),
        "settings_hash": settings_hash(settings) if settings else None, "settings": settings,
        "load_before": _load1(meta, "before"), "load_after": _load1(meta, "after"),
        "run_dir": str(run_dir),
    }
    kept = kept.assign(run=facts["run"], config=facts["config"], ranks=ranks)
    return facts, kept.reset_index(drop=True)


def load(paths: Sequence[str | os.PathLike] | str | os.PathLike,
         skipped: list | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Load the records of run or sweep directories into two tables.

    Only steps that every rank of a run recorded are kept; warm-up steps are still in (see
    ``hpcpar.analysis.drop_warmup``).

    Args:
        paths: Run or sweep directories, at any depth.
        skipped: A list that receives the one-line reason of each run whose meta.json cannot
            be used; such runs are reported with ``warnings.warn`` when None.

    Returns:
        ``(runs, steps)``: one row per run (``RUN_COLUMNS``), and the step records of every
        run (the schema columns of ``hpcpar.formats.records`` plus ``run``, ``config``,
        ``ranks``).

    Raises:
        RunDirError: No readable run at all.
    """
    facts, frames, reasons = [], [], []
    for run in find_runs(paths):
        try:
            parts = load_run_parts(run)
        except RunDirError as exc:
            reasons.append(str(exc))
            continue
        for f, s in parts:
            facts.append(f)
            frames.append(s)
    if reasons and not facts:
        more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
        raise RunDirError(f"no readable run records: {reasons[0]}{more}")
    if skipped is not None:
        skipped += reasons
    else:
        for reason in reasons:
            warnings.warn(f"skipped run: {reason}", stacklevel=2)
    runs = pd.DataFrame(facts, columns=list(RUN_COLUMNS))
    steps = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return runs, steps
