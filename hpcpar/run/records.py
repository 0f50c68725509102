"""Per-step run records: the versioned schema, the writer the training loop uses, the reader.

A run directory holds::

    RUN/meta.json                 one JSON object (META_KEYS): job, grid, hosts, versions, times
    RUN/records/rank-00000.csv    one line per step of rank 0, appended and flushed every step
    RUN/records/rank-00001.csv    ... (one file per rank: rows survive a crash of any rank)
    RUN/steps.parquet             all ranks merged at finish

The schema lives here and only here (:data:`COLUMNS`, :data:`SCHEMA_VERSION`); the analysis
reads it back with :func:`read_steps`. Bump ``SCHEMA_VERSION`` on any incompatible change.
No torch import: the recorder is plain Python so the analysis side can use it anywhere.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import math
import numbers
import os
import platform
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcpar.errors import RunDirError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    import pandas as pd

    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["SCHEMA_VERSION", "SCHEMA_NAME", "Column", "COLUMNS", "COLUMN_NAMES", "META_KEYS",
           "STATUSES", "OPTIONAL_COLUMNS", "now_iso", "package_versions", "slurm_facts",
           "rank_machine_facts", "machine_facts", "git_facts", "LocalComm",
           "LocalGrid", "encode_row", "row_from_counters", "write_json_atomic", "read_meta",
           "RunRecorder", "read_rank_file", "merge_records", "read_steps", "schema_markdown"]

SCHEMA_VERSION = 1
SCHEMA_NAME = "hpcpar.run"


@dataclass(frozen=True)
class Column:
    """One column of the step table.

    Attributes:
        name: Column name.
        kind: ``"int"`` or ``"float"``.
        unit: Unit (``"s"``, ``"B"``...).
        doc: One line saying what it measures.
    """

    name: str
    kind: str  # "int" or "float"
    unit: str
    doc: str


#: The step table: one row per rank per step. Times are wall seconds measured by that rank.
#: Phases nest like this: t_step ~= t_data + t_fwd + t_bwd + t_allreduce_exposed + t_opt (+ the
#: rest of the loop); t_halo is the part of t_fwd + t_bwd spent in halo exchanges.
COLUMNS: tuple[Column, ...] = (
    Column("step", "int", "step", "optimizer step index (same on every rank; 0-based)"),
    Column("rank", "int", "rank", "world rank that measured the row"),
    Column("loss", "float", "-", "training loss of the step as seen by this rank"),
    Column("t_data", "float", "s", "waiting for the next batch (I/O wait)"),
    Column("t_fwd", "float", "s", "forward pass, halo exchanges inside it included"),
    Column("t_bwd", "float", "s", "backward pass, halo exchanges included, exposed allreduce "
                                  "excluded"),
    Column("t_halo", "float", "s", "halo exchanges (spatial and graph), forward + backward"),
    Column("t_allreduce_exposed", "float", "s", "waiting for gradient sync after backward"),
    Column("t_allreduce_total", "float", "s", "first bucket launch to last bucket done "
                                              "(overlapped + exposed)"),
    Column("t_opt", "float", "s", "optimizer step"),
    Column("t_step", "float", "s", "whole step, wall clock"),
    Column("samples", "int", "samples", "samples in this rank's data-parallel replica batch "
                                        "(ranks of one spatial group report the same number)"),
    Column("bytes_halo", "int", "B", "bytes sent in halo exchanges"),
    Column("bytes_allreduce", "int", "B", "gradient bytes reduced (as sent on the wire)"),
    Column("bytes_read", "int", "B", "bytes read from storage by this rank"),
    Column("peak_mem", "float", "B", "peak memory of this rank so far (device, else host RSS)"),
    Column("t_halo_wait", "float", "s", "the communication part of t_halo: waiting for "
                                        "neighbours' messages (spatial) and the graph "
                                        "all-to-all; t_halo - t_halo_wait is local copies and "
                                        "padding"),
    Column("t_check", "float", "s", "the replica check ([train] check_replicas_every; 0 on "
                                    "other steps)"),
)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)
#: Columns added to schema v1 after its first release, always at the end: files written
#: without them are read with the columns empty (NaN), so older runs stay readable.
OPTIONAL_COLUMNS = ("t_halo_wait", "t_check")
#: The column lists files may have: the full one, or without the newest optional columns.
_ACCEPTED_NAMES = tuple(COLUMN_NAMES[: len(COLUMN_NAMES) - i]
                        for i in range(len(OPTIONAL_COLUMNS) + 1))
_KIND = {c.name: c.kind for c in COLUMNS}

#: meta.json keys written by the recorder (callers may add their own keys through ``meta``).
META_KEYS = {
    "schema": "always 'hpcpar.run'", "schema_version": "SCHEMA_VERSION of the files",
    "job_name": "job name ([job] name)", "job": "the job spec as run (dict)",
    "job_file": "path of the job TOML, if any", "config": "label runs are grouped by in reports "
    "(default: job_name)", "global_batch": "samples per step over all ranks, if known",
    "problem_size": "optional work per sample (e.g. voxels) when it changes between runs",
    "timing_warmup": "optional: steps the report drops at each (re)start (default n/10)",
    "grid": "{data, x, y, z}", "grid_spec": "'DxXxYxZ'", "ranks": "world size",
    "nodes": "number of nodes", "hostnames": "sorted distinct host names",
    "rank_hosts": "host of each rank", "slurm": "Slurm job facts or null",
    "start_time": "ISO 8601 UTC of the first start", "end_time": "ISO 8601 UTC of finish or null",
    "status": "running | ok | preempted | failed | diverged (diverged: non-finite "
              "loss/gradient, see 'diverged'; every way a run ends replaces running)",
    "end_reason": "one line: why the run ended, when it did not end ok (the error, the "
                  "signal, the launcher's exit code)",
    "segments": "one entry per start/resume: start time and first step recorded",
    "diverged": "{step, reason} when status is 'diverged' (written by the training loop)",
    "versions": "python, hpcpar, torch, mpi4py, mpi_library, numba, h5py, ...",
    "git": "{commit, dirty, root} of the job file's repository, or null",
    "machine": "{cores_per_node, cores_source, ranks_per_node, threads_per_rank, "
               "oversubscribed, hosts: {host: {ranks, cores, threads}}} (machine_facts)",
}

STATUSES = ("running", "ok", "preempted", "failed", "diverged")
_HEADER_TAG = f"# {SCHEMA_NAME} steps schema_version="


def now_iso() -> str:
    """The current UTC time, ISO 8601 with milliseconds."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


# -- environment facts ----------------------------------------------------------------------
def package_versions() -> dict:
    """Versions of the stack, read from package metadata (nothing heavy is imported)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("hpcpar", "torch", "mpi4py", "numpy", "numba", "h5py", "mpich"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        from mpi4py import MPI

        out["mpi_library"] = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        out["mpi_standard"] = "{}.{}".format(*MPI.Get_version())
    except Exception:  # noqa: BLE001 - a missing MPI must not stop a record
        out["mpi_library"] = None
    return out


def slurm_facts(env: Mapping[str, str] | None = None) -> dict | None:
    """Slurm job id, node list and friends from the environment.

    Args:
        env: The environment; ``os.environ`` when None.

    Returns:
        The facts, or None outside Slurm.
    """
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return None
    keys = {"job_id": job, "node_list": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
            "job_name": env.get("SLURM_JOB_NAME"), "partition": env.get("SLURM_JOB_PARTITION"),
            "account": env.get("SLURM_JOB_ACCOUNT"), "ntasks": env.get("SLURM_NTASKS"),
            "num_nodes": env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"),
            "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
            "array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
            "restart_count": env.get("SLURM_RESTART_COUNT"),
            "cluster": env.get("SLURM_CLUSTER_NAME")}
    return {k: v for k, v in keys.items() if v is not None}


def _int_or_none(text) -> int | None:
    try:
        return int(str(text).split("(")[0].split(",")[0])  # "4(x2)" / "4,4" Slurm forms
    except (TypeError, ValueError):
        return None


def rank_machine_facts(env: Mapping[str, str] | None = None) -> dict:
    """What one rank sees of its node: host, CPUs it may run on, threads it computes with.

    ``cpus`` is this process's affinity set (``os.sched_getaffinity``; all logical CPUs
    where that is unavailable), ``cpu_count`` the node's logical CPUs, ``slurm_cpus`` Slurm's
    ``SLURM_CPUS_ON_NODE`` (the CPUs the job holds on the node), ``threads`` torch's intra-op
    threads when torch is loaded, else ``OMP_NUM_THREADS``, else None (unknown).

    Args:
        env: The environment; ``os.environ`` when None.

    Returns:
        ``{host, cpus (list), cpu_count, slurm_cpus, threads}``.
    """
    import sys

    env = os.environ if env is None else env
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    torch = sys.modules.get("torch")
    threads = None
    if torch is not None and hasattr(torch, "get_num_threads"):
        threads = int(torch.get_num_threads())
    elif env.get("OMP_NUM_THREADS"):
        threads = _int_or_none(env["OMP_NUM_THREADS"])
    return {"host": socket.gethostname(), "cpus": cpus, "cpu_count": os.cpu_count(),
            "slurm_cpus": _int_or_none(env.get("SLURM_CPUS_ON_NODE")), "threads": threads}


def machine_facts(per_rank: Sequence[dict]) -> dict:
    """Cores per node, ranks per node and threads per rank from every rank's
    :func:`rank_machine_facts`, and whether the run was oversubscribed.

    cores of a node = Slurm's CPUs on the node when set, else the union of its ranks'
    affinity sets (what the ranks could use). cores_per_node, ranks_per_node and
    threads_per_rank are the values of the most crowded node (where the ratio
    ranks x threads / cores is largest); oversubscribed = ranks x threads > cores on any
    node (None when the threads are unknown).

    Args:
        per_rank: One dict per rank (``comm.allgather(rank_machine_facts())``).

    Returns:
        ``{cores_per_node, cores_source, ranks_per_node, threads_per_rank, oversubscribed,
        hosts}``.
    """
    hosts: dict = {}
    for f in per_rank:
        h = hosts.setdefault(f["host"], {"ranks": 0, "cpus": set(), "slurm": None,
                                         "threads": []})
        h["ranks"] += 1
        h["cpus"].update(f.get("cpus") or [])
        h["slurm"] = f.get("slurm_cpus") or h["slurm"]
        h["threads"].append(f.get("threads"))
    out_hosts, worst, source = {}, None, "affinity"
    for name, h in sorted(hosts.items()):
        cores = h["slurm"] or len(h["cpus"]) or None
        source = "SLURM_CPUS_ON_NODE" if h["slurm"] else source
        known = [t for t in h["threads"] if t is not None]
        threads = max(known) if len(known) == len(h["threads"]) and known else None
        out_hosts[name] = {"ranks": h["ranks"], "cores": cores, "threads": threads}
        load = h["ranks"] * (threads or 1) / (cores or 1)
        if worst is None or load > worst[0]:
            worst = (load, name)
    w = out_hosts[worst[1]] if worst else {"ranks": None, "cores": None, "threads": None}
    over = [h["ranks"] * h["threads"] > h["cores"] for h in out_hosts.values()
            if h["threads"] is not None and h["cores"]]
    return {"cores_per_node": w["cores"], "cores_source": source,
            "ranks_per_node": w["ranks"], "threads_per_rank": w["threads"],
            "oversubscribed": any(over) if len(over) == len(out_hosts) or any(over) else None,
            "hosts": out_hosts}


def git_facts(path: str | os.PathLike | None) -> dict | None:
    """Commit, dirtiness and root of the git repository holding a file.

    Args:
        path: A file or directory (the job file).

    Returns:
        The facts, or None outside a repository (or without git).
    """
    if not path:
        return None
    where = Path(path).resolve()
    where = where if where.is_dir() else where.parent
    if not where.exists():
        return None

    def git(*args):
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        root = git("rev-parse", "--show-toplevel")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty, "root": root}


def _grid_facts(grid) -> dict:
    shape = tuple(int(s) for s in grid.shape)
    return {"grid": dict(zip(("data", "x", "y", "z"), shape)),
            "grid_spec": "x".join(str(s) for s in shape), "ranks": int(grid.size),
            "nodes": int(getattr(grid, "num_nodes", 1))}


class LocalComm:
    """Stand-in communicator for recording without MPI: rank ``rank`` of ``size`` processes
    that never talk (``grid=None`` uses one rank; synthetic runs write each rank in turn)."""

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def allgather(self, x):
        return [x] * self.size

    def bcast(self, x, root=0):
        return x

    def Barrier(self):
        pass


class LocalGrid:
    """Grid facts for a recorder without MPI.

    Args:
        shape: ``(data, x, y, z)``.
        rank: The rank this process records as.
        nodes: Number of nodes to record.
    """

    def __init__(self, shape: Sequence[int] = (1, 1, 1, 1), rank: int = 0, nodes: int = 1):
        self.shape = tuple(shape)
        self.size = self.shape[0] * self.shape[1] * self.shape[2] * self.shape[3]
        self.rank, self.num_nodes = rank, nodes
        self.comm = LocalComm(rank, self.size)


# -- row encoding ----------------------------------------------------------------------------
def _cell(name: str, value) -> str:
    if value is None:
        return ""
    if _KIND[name] == "int":
        if isinstance(value, float) and value != value:
            return ""
        return str(int(value))
    return repr(float(value))  # shortest text that reads back to the same double


def encode_row(row: dict, names: Sequence[str] = COLUMN_NAMES) -> str:
    """Encode a step row as one CSV line.

    Args:
        row: Column name -> value; missing columns are left empty.
        names: The file's columns (a file begun before an optional column existed keeps
            its own columns on resume; values of columns it lacks are not written).

    Returns:
        The line, with its newline.

    Raises:
        KeyError: A column not in the schema (a bug).
    """
    unknown = set(row) - set(COLUMN_NAMES)
    if unknown:
        raise KeyError(f"step record: unknown column(s) {sorted(unknown)}; schema v"
                       f"{SCHEMA_VERSION} has {', '.join(COLUMN_NAMES)}")
    return ",".join(_cell(n, row.get(n)) for n in names) + "\n"


def row_from_counters(delta: dict) -> dict:
    """Map counter differences onto step columns (graph halos count as halo time).

    Args:
        delta: What ``hpcpar.parallel.counters.Counters.since`` returned.

    Returns:
        The step columns among them.
    """
    row = {k: v for k, v in delta.items() if k in _KIND}
    if "t_graph_halo" in delta:
        row["t_halo"] = row.get("t_halo", 0.0) + delta["t_graph_halo"]
    return row


def _file_columns(path: Path) -> tuple:
    """The columns of an existing rank file (rows appended on resume keep to them)."""
    with open(path, "rb") as f:
        line = f.readline()
        if line.startswith(_HEADER_TAG.encode()):  # a file written before 0.2: a tag line
            line = f.readline()
    names = tuple(line.decode(errors="replace").strip().split(","))
    return names if names in _ACCEPTED_NAMES else COLUMN_NAMES


def _header() -> str:
    """The first line of a rank file: the column names, so ``pandas.read_csv(path)`` reads it
    as it is (the schema version is in meta.json)."""
    return ",".join(COLUMN_NAMES) + "\n"


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that a crash left without its newline (so appends start clean)."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)


def strict_json(obj: Any) -> Any:
    """Make a value dump as strict JSON (``allow_nan=False``) that any parser reads.

    Args:
        obj: Nested dicts, lists and scalars.

    Returns:
        A copy with NaN/inf floats as None (JSON ``null``) and numpy scalars as Python
        numbers.
    """
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, numbers.Number) and not isinstance(obj, int) and hasattr(obj, "item"):
        return strict_json(obj.item())  # numpy scalar
    return obj


def _oserror(exc: OSError) -> str:
    return exc.strerror or str(exc)


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write strict JSON atomically: a temporary file, fsync, then rename.

    Readers see the old or the new file, never half of one.

    Args:
        path: The file to write.
        obj: The content (NaN/inf are written as null, see ``strict_json``).

    Raises:
        RunDirError: An OSError (disk full, permissions), naming the file; the old file is
            left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    text = json.dumps(strict_json(obj), indent=2, sort_keys=True, default=str,
                      allow_nan=False) + "\n"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise RunDirError(f"{path}: cannot write ({_oserror(exc)}); the previous version, if "
                          f"any, is unchanged") from None


def read_meta(run_dir: str | os.PathLike) -> dict:
    """Read a run's meta.json, checked for schema name and version.

    Args:
        run_dir: The run directory.

    Returns:
        The meta dict.

    Raises:
        RunDirError: Missing or unreadable, or another schema or version.
    """
    path = Path(run_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing (not an hpcpar run directory)") from None
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path}: unreadable JSON ({exc})") from None
    except RecursionError:
        raise RunDirError(f"{path}: unreadable JSON (arrays or objects nest too deeply)") \
            from None
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA_NAME:
        raise RunDirError(f"{path}: not an hpcpar run record (schema {SCHEMA_NAME!r} expected)")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise RunDirError(f"{path}: schema version {meta.get('schema_version')!r}, this hpcpar "
                          f"reads version {SCHEMA_VERSION}")
    return meta


# -- the writer ------------------------------------------------------------------------------
class RunRecorder:
    """Writes one run's records: ``meta.json`` and one CSV row per rank per step, merged into
    ``steps.parquet`` at the end (format: ``docs/guides/analysis.md``).

    Construction and [finish][hpcpar.run.records.RunRecorder.finish] are collective over
    ``grid.comm``; [step][hpcpar.run.records.RunRecorder.step] is local (every rank records
    its own row every step).

    Args:
        run_dir: The run directory; records go to ``run_dir/records``.
        grid: The process grid; None records a single process without MPI.
        meta: Caller facts stored in meta.json (``job_name``, ``job`` dict, ``job_file``,
            ``global_batch``, ``config``, anything else JSON-able).
        resume: Keep the rows and start time already there; rows of steps redone after the
            checkpoint replace the old ones when the records are merged.

    Raises:
        RunDirError: Rank 0 cannot create the records or read the existing meta.json (the
            same error on every rank).

    Example:
        ```python
        rec = RunRecorder("runs/a", grid, meta={"job_name": "demo", "global_batch": 16})
        rec.step(step=0, t_step=0.41, samples=16)
        rec.finish()
        ```
    """

    def __init__(self, run_dir: str | os.PathLike, grid: ProcessGrid | LocalGrid | None = None,
                 meta: dict | None = None, resume: bool = False):
        self.grid = grid if grid is not None else LocalGrid()
        self.comm = self.grid.comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self.run_dir = Path(run_dir)
        self.records_dir = self.run_dir / "records"
        self._first_step_seen = False
        facts = self.comm.allgather(rank_machine_facts())
        hosts = [f["host"] for f in facts]
        error = None
        if self.rank == 0:
            try:
                self.records_dir.mkdir(parents=True, exist_ok=True)
                self._start_meta(dict(meta or {}), hosts, resume, machine_facts(facts))
            except RunDirError as exc:
                error = f"{self.run_dir}: cannot start run records: {exc}"
            except OSError as exc:
                error = (f"{exc.filename or self.run_dir}: cannot start run records "
                         f"({_oserror(exc)})")
        error = self.comm.bcast(error, root=0)
        if error:
            raise RunDirError(error)
        self.path = self.records_dir / f"rank-{self.rank:05d}.csv"
        if resume and self.path.exists():
            _drop_torn_tail(self.path)
        fresh = not (resume and self.path.exists() and self.path.stat().st_size > 0)
        self._names = COLUMN_NAMES if fresh else _file_columns(self.path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                               | (os.O_TRUNC if fresh else 0), 0o666)
        except OSError as exc:
            raise RunDirError(f"{self.path}: cannot open step records ({_oserror(exc)})") \
                from None
        self._complete = os.lseek(self._fd, 0, os.SEEK_END)  # bytes in whole lines
        if fresh:
            self._write(_header())

    def _write(self, text: str) -> None:
        """Append whole lines: one ``write`` (retried on short writes). On any OSError (disk
        full, quota, I/O error) the file is cut back to its last complete line and one
        :class:`RunDirError` names it: a torn line is never left behind."""
        data = memoryview(text.encode())
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            try:
                os.ftruncate(self._fd, self._complete)
            except OSError:
                pass
            raise RunDirError(f"{self.path}: cannot write step records ({_oserror(exc)}); "
                              f"the records up to the last complete step are kept") from None
        self._complete += len(text.encode())

    def _start_meta(self, user: dict, hosts: list, resume: bool, machine: dict) -> None:
        path = self.run_dir / "meta.json"
        previous = read_meta(self.run_dir) if resume and path.exists() else None
        start = now_iso()
        meta = dict(previous or {})
        meta.pop("end_reason", None)        # a new segment: the last one's ending is history
        meta.update(user)
        meta.update(_grid_facts(self.grid))
        meta.update({
            "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
            "hostnames": sorted(set(hosts)), "rank_hosts": hosts, "slurm": slurm_facts(),
            "start_time": (previous or {}).get("start_time", start), "end_time": None,
            "status": "running", "versions": package_versions(),
            "git": git_facts(user.get("job_file")), "machine": user.get("machine", machine),
        })
        job = user.get("job")
        meta.setdefault("job_name", job.get("name") if isinstance(job, dict) else job)
        meta["segments"] = list((previous or {}).get("segments", [])) + [
            {"start_time": start, "first_step": None}]
        write_json_atomic(path, meta)

    def step(self, **row: Any) -> None:
        """Append this rank's row of one step and flush it to the OS (it survives a crash).

        Args:
            **row: Values of the step columns (``COLUMNS``; ``rank`` is filled in, missing
                columns are left empty).

        Raises:
            RunDirError: The row cannot be written (disk full...); no torn line is left.
        """
        row.setdefault("rank", self.rank)
        if "step" not in row or row["step"] is None:
            raise KeyError("step record: 'step' is required")
        self._write(encode_row({k: v for k, v in row.items() if k in self._names}
                               | {k: v for k, v in row.items() if k not in COLUMN_NAMES},
                               self._names))
        if self.rank == 0 and not self._first_step_seen:
            self._first_step_seen = True
            self.update_meta(lambda m: m["segments"][-1].update(first_step=int(row["step"])))

    def update_meta(self, change: Callable[[dict], None]) -> None:
        """Apply ``change(meta_dict)`` to meta.json atomically (rank 0 only).

        Args:
            change: Called with the meta dict; modifies it in place.
        """
        meta = read_meta(self.run_dir)
        change(meta)
        write_json_atomic(self.run_dir / "meta.json", meta)

    def close(self) -> None:
        """Local: sync and close this rank's file (error paths too; no collective)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            except OSError:  # the rows are in the page cache already; nothing to add
                pass
            os.close(fd)

    def finish(self, status: str = "ok", reason: str | None = None) -> Path | None:
        """Close every rank's file, merge them, and record the end time and status (collective).

        Args:
            status: The run's final status for meta.json (``"ok"``, ``"stopped"``,
                ``"failed"``...).
            reason: Why the run ended, stored as ``end_reason`` (None removes an earlier one).

        Returns:
            The merged ``steps.parquet`` on rank 0; None on
            the other ranks.
        """
        if status not in STATUSES[1:]:
            raise ValueError(f"finish status must be one of {STATUSES[1:]}, got {status!r}")
        self.close()
        self.comm.Barrier()
        out, error = None, None
        if self.rank == 0:
            try:
                out = merge_records(self.run_dir)
                self.update_meta(lambda m: m.update(end_time=now_iso(), status=status,
                                                    end_reason=reason, steps_file=out.name))
            except RunDirError as exc:
                error = f"{self.run_dir}: cannot merge run records: {exc}"
            except OSError as exc:  # disk full while writing steps.parquet: rank files stay
                error = (f"{exc.filename or self.run_dir}: cannot merge run records "
                         f"({_oserror(exc)}); records/rank-*.csv are kept")
        error = self.comm.bcast(error, root=0)
        if error:
            raise RunDirError(error)
        return out


# -- the reader ------------------------------------------------------------------------------
_REQUIRED = ("step", "rank")  # never empty in a row the recorder wrote


def _short(path: Path) -> str:
    """``records/rank-00001.csv`` style name for notes."""
    return f"{path.parent.name}/{path.name}"


def _typed(df):
    """Schema dtypes: int columns int64 (float64 when a cell is empty), float columns float64."""
    import pandas as pd

    out = {}
    for name in COLUMN_NAMES:
        if name not in df:  # an optional column the file predates
            out[name] = pd.Series(math.nan, index=df.index, dtype="float64")
            continue
        col = pd.to_numeric(df[name], errors="coerce").astype("float64")
        if _KIND[name] == "int" and not col.isna().any():
            col = col.astype("int64")
        out[name] = col
    return pd.DataFrame(out, index=df.index)


def _parse_line(line: bytes, rank: int | None, names: Sequence[str] = COLUMN_NAMES):
    """Values of one CSV row of the schema, or None when the line is not one (wrong number of
    fields, text in a number, empty step/rank, another rank's row in a rank file)."""
    try:
        cells = line.decode("ascii").split(",")
    except UnicodeDecodeError:
        return None
    if len(cells) != len(names):
        return None
    values = []
    for name, cell in zip(names, cells):
        cell = cell.strip()
        if not cell:
            if name in _REQUIRED:
                return None
            values.append(math.nan)
            continue
        try:
            v = int(cell) if _KIND[name] == "int" else float(cell)
        except ValueError:
            return None
        if name in _REQUIRED and v < 0:
            return None
        values.append(v)
    if rank is not None and values[1] != rank:
        return None
    return values


def _fast_rows(header: bytes, rows: bytes, rank: int | None, lines: int,
               names: Sequence[str] = COLUMN_NAMES):
    """pandas' C parser on a healthy segment; None when anything looks off (then the careful
    line-by-line parser decides)."""
    import pandas as pd

    try:
        df = pd.read_csv(io.BytesIO(header + b"\n" + rows))
    except Exception:  # noqa: BLE001 - any parser complaint: read line by line instead
        return None
    if len(df) != lines or rows.count(b",") != lines * (len(names) - 1):
        return None
    if tuple(df.columns) != tuple(names) or any(df[c].dtype.kind not in "iuf" for c in df):
        return None
    if df[list(_REQUIRED)].isna().any().any() or (df[list(_REQUIRED)] < 0).any().any():
        return None
    if rank is not None and len(df) and not (df["rank"] == rank).all():
        return None
    return _typed(df)


def _parse_rows(header: bytes, rows: bytes, rank: int | None, bad: list,
                names: Sequence[str] = COLUMN_NAMES):
    """Rows of one segment of a rank file; lines that are not rows go to ``bad``."""
    import pandas as pd

    rows = b"\n".join(line for line in rows.split(b"\n") if line.strip()) + b"\n"
    lines = rows.count(b"\n") if rows.strip() else 0
    if not lines:
        return _typed(pd.DataFrame({c: [] for c in COLUMN_NAMES}))
    df = _fast_rows(header, rows, rank, lines, names)
    if df is not None:
        return df
    good = []
    for line in rows.split(b"\n")[:-1]:
        values = _parse_line(line, rank, names)
        if values is None:
            bad.append(line)
        else:
            good.append(values)
    return _typed(pd.DataFrame(good or None, columns=list(names)))


def read_rank_file(path: str | os.PathLike, notes: list | None = None) -> pd.DataFrame:
    """Read one rank's step file.

    A torn last line (crash mid-write) is dropped; where the step goes back (a resumed run
    appending from its checkpoint), every earlier row at or past that step is replaced (steps
    redone after the checkpoint, and stale ones the crash left behind). Lines that are not
    rows of the schema (damage, another rank's row) are left out. Files of older hpcpar
    versions (a schema tag line first, ``# resume`` lines) read the same.

    Args:
        path: The ``rank-NNNNN.csv`` file.
        notes: A list that receives one note saying how many lines were left out.

    Returns:
        The rank's step table.

    Raises:
        RunDirError: The file is not a step record of this schema version.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RunDirError(f"{path}: unreadable ({_oserror(exc)})") from None
    if data.startswith(_HEADER_TAG.encode()):  # written before 0.2: a schema tag line first
        tag, _, data = data.partition(b"\n")
        version = tag[len(_HEADER_TAG):].decode(errors="replace").strip()
        if version != str(SCHEMA_VERSION):
            raise RunDirError(f"{path}: schema version {version}, this hpcpar reads version "
                              f"{SCHEMA_VERSION}")
    if not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
    header, _, body = data.partition(b"\n")
    names = tuple(header.decode(errors="replace").split(","))
    if names not in _ACCEPTED_NAMES:
        raise RunDirError(f"{path}: not an hpcpar step record (first line "
                          f"{header[:60].decode(errors='replace')!r})")
    name = path.name
    rank = int(name[5:-4]) if name.startswith("rank-") and name[5:-4].isdigit() else None
    rows = b"\n".join(line for line in body.split(b"\n") if not line.startswith(b"#"))
    bad: list = []
    df = _parse_rows(header, rows, rank, bad, names)
    if bad and notes is not None:
        notes.append(f"{_short(path)}: {len(bad)} unreadable line(s) left out (first: "
                     f"{bad[0][:40].decode(errors='replace')!r})")
    return _latest_segments(df)


def _latest_segments(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in file order -> one row per step, the latest run's. A resumed run appends from
    its checkpoint's step, so wherever the step goes back (or repeats) a new segment starts,
    and it replaces every earlier row at or past its first step: steps redone after the
    checkpoint, and stale ones the crash left behind."""
    import numpy as np

    steps = df["step"].to_numpy()
    starts = [0, *(np.flatnonzero(steps[1:] <= steps[:-1]) + 1), len(df)]
    out = df.iloc[starts[0]:starts[1]]
    for a, b in zip(starts[1:-1], starts[2:]):
        seg = df.iloc[a:b]
        out = pd_concat([out[out["step"] < seg["step"].min()], seg])
    return out.drop_duplicates(["rank", "step"], keep="last").reset_index(drop=True)


def pd_concat(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate step tables, keeping the schema's column types.

    Args:
        frames: The step tables.

    Returns:
        One table with a fresh index and the schema's column types.
    """
    import pandas as pd

    return _typed(pd.concat(frames, ignore_index=True))


def _sorted(df):
    return df.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def _read_rank_files(files, notes: list | None):
    """All rank files merged; with ``notes``, a file that cannot be read is skipped and noted
    (its rank then counts as missing), else it raises."""
    frames = []
    for f in files:
        try:
            frames.append(read_rank_file(f, notes))
        except RunDirError as exc:
            if notes is None:
                raise
            notes.append(f"{_short(f)} skipped: {str(exc).removeprefix(f'{f}: ')}")
    if not frames:
        raise RunDirError(f"{files[0].parent}: no readable rank-*.csv step records")
    return _sorted(pd_concat(frames))


def merge_records(run_dir: str | os.PathLike) -> Path:
    """Merge a run's per-rank step files into one table.

    Damaged lines and unreadable rank files are left out (the rank files stay as they are).

    Args:
        run_dir: The run directory.

    Returns:
        ``RUN/steps.parquet``.

    Raises:
        RunDirError: No rank files.
    """
    run_dir = Path(run_dir)
    files = sorted((run_dir / "records").glob("rank-*.csv"))
    if not files:
        raise RunDirError(f"{run_dir / 'records'}: no rank-*.csv step records")
    df = _read_rank_files(files, [])
    import pyarrow as pa  # a required dependency: records are always parquet
    import pyarrow.parquet as pq

    out = run_dir / "steps.parquet"
    tmp = out.with_name(".steps.parquet.tmp")
    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[b"hpcpar.schema_version"] = str(SCHEMA_VERSION).encode()
    pq.write_table(table.replace_schema_metadata(meta), tmp)
    os.replace(tmp, out)
    return out


def _read_parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own types for broken files
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        why = why.replace(f" '{path}'", "").replace(str(path), path.name).split(". ")[0]
        raise RunDirError(f"{path}: unreadable ({why[:160]})") from None
    version = (table.schema.metadata or {}).get(b"hpcpar.schema_version", b"?").decode()
    if version != str(SCHEMA_VERSION):
        raise RunDirError(f"{path}: schema version {version}, this hpcpar reads "
                          f"version {SCHEMA_VERSION}")
    return table.to_pandas()


def read_steps(run_dir: str | os.PathLike, notes: list | None = None) -> pd.DataFrame:
    """The step table of a run, checked against the schema version.

    Reads steps.parquet / steps.csv when the run finished, else the per-rank files (a
    crashed or running run).

    Args:
        run_dir: The run directory.
        notes: Without a list, any damage raises. With one, the reader keeps what it can and
            appends one line per problem: a merged file that cannot be read falls back to
            the rank files, an unreadable rank file is skipped, damaged lines are left out.

    Returns:
        One row per rank per step.

    Raises:
        RunDirError: Damage (without ``notes``), or no step records at all.
    """
    run_dir = Path(run_dir)
    parquet, csv = run_dir / "steps.parquet", run_dir / "steps.csv"
    rank_files = sorted((run_dir / "records").glob("rank-*.csv"))
    newest_rank = max((f.stat().st_mtime for f in rank_files), default=0.0)
    df = None
    for merged, reader in ((parquet, _read_parquet), (csv, lambda f: read_rank_file(f, notes))):
        if df is None and merged.exists() and merged.stat().st_mtime >= newest_rank:
            try:
                df = reader(merged)
            except RunDirError as exc:
                if notes is None or not rank_files:
                    raise
                notes.append(f"{merged.name} {str(exc).removeprefix(f'{merged}: ')}: read "
                             f"records/rank-*.csv instead")
    if df is None and rank_files:
        df = _read_rank_files(rank_files, notes)
    if df is None:
        raise RunDirError(f"{run_dir}: no step records (steps.parquet, steps.csv or "
                          f"records/rank-*.csv)")
    for c in OPTIONAL_COLUMNS:  # a merged file written before the column existed
        if c not in df.columns:
            df[c] = math.nan
    missing = [c for c in COLUMN_NAMES if c not in df.columns]
    if missing:
        raise RunDirError(f"{run_dir}: step records lack column(s) {missing}")
    return df[list(COLUMN_NAMES)]


def schema_markdown() -> str:
    """The step schema as a Markdown table (README and report)."""
    lines = [f"Step records, schema version {SCHEMA_VERSION}:", "",
             "| column | type | unit | meaning |", "|---|---|---|---|"]
    lines += [f"| `{c.name}` | {c.kind} | {c.unit} | {c.doc} |" for c in COLUMNS]
    return "\n".join(lines) + "\n"
