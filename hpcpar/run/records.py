"""Per-step run records: the versioned schema, the writer the training loop uses, the reader.

A run directory holds::

    RUN/meta.json                 one JSON object (META_KEYS): job, grid, hosts, versions, times
    RUN/records/rank-00000.csv    one line per step of rank 0, appended and flushed every step
    RUN/records/rank-00001.csv    ... (one file per rank: rows survive a crash of any rank)
    RUN/steps.parquet             all ranks merged at finish (steps.csv when pyarrow is absent)

The schema lives here and only here (:data:`COLUMNS`, :data:`SCHEMA_VERSION`); the analysis
reads it back with :func:`read_steps`. Bump ``SCHEMA_VERSION`` on any incompatible change.
No torch import: the recorder is plain Python so the analysis side can use it anywhere.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import platform
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpcpar.errors import HpcparError

SCHEMA_VERSION = 1
SCHEMA_NAME = "hpcpar.run"


@dataclass(frozen=True)
class Column:
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
)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)
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
    "status": "running | ok | preempted | failed (running after the end = crashed)",
    "segments": "one entry per start/resume: start time and first step recorded",
    "versions": "python, hpcpar, torch, mpi4py, mpi_library, numba, h5py, ...",
    "git": "{commit, dirty, root} of the job file's repository, or null",
}

STATUSES = ("running", "ok", "preempted", "failed")
_HEADER_TAG = f"# {SCHEMA_NAME} steps schema_version="
_RESUME_MARK = b"# resume"


class RecordsError(HpcparError, ValueError):
    """Run records are missing, truncated or of another schema version."""


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


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
        out["mpi_standard"] = "%d.%d" % MPI.Get_version()
    except Exception:  # noqa: BLE001 - a missing MPI must not stop a record
        out["mpi_library"] = None
    return out


def slurm_facts(env=None) -> dict | None:
    """Slurm job id, node list and friends from the environment, or None outside Slurm."""
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


def git_facts(path) -> dict | None:
    """Commit, dirtiness and root of the git repository holding ``path``, or None."""
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
    """Grid facts for a recorder without MPI (``shape`` = (data, x, y, z))."""

    def __init__(self, shape=(1, 1, 1, 1), rank: int = 0, nodes: int = 1):
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


def encode_row(row: dict) -> str:
    """One CSV line (with newline) of a step row; unknown columns are a bug and raise."""
    unknown = set(row) - set(COLUMN_NAMES)
    if unknown:
        raise KeyError(f"step record: unknown column(s) {sorted(unknown)}; schema v"
                       f"{SCHEMA_VERSION} has {', '.join(COLUMN_NAMES)}")
    return ",".join(_cell(n, row.get(n)) for n in COLUMN_NAMES) + "\n"


def row_from_counters(delta: dict) -> dict:
    """Map a :meth:`hpcpar.parallel.counters.Counters.since` dict onto schema columns (graph halos count
    as halo time)."""
    row = {k: v for k, v in delta.items() if k in _KIND}
    if "t_graph_halo" in delta:
        row["t_halo"] = row.get("t_halo", 0.0) + delta["t_graph_halo"]
    return row


def _header() -> str:
    return f"{_HEADER_TAG}{SCHEMA_VERSION}\n" + ",".join(COLUMN_NAMES) + "\n"


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


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_meta(run_dir) -> dict:
    """meta.json of a run, checked for schema name and version."""
    path = Path(run_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordsError(f"{path}: missing (not an hpcpar run directory)") from None
    except (OSError, ValueError) as exc:
        raise RecordsError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA_NAME:
        raise RecordsError(f"{path}: not an hpcpar run record (schema {SCHEMA_NAME!r} expected)")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise RecordsError(f"{path}: schema version {meta.get('schema_version')!r}, this hpcpar "
                           f"reads version {SCHEMA_VERSION}")
    return meta


# -- the writer ------------------------------------------------------------------------------
class RunRecorder:
    """Writes one run's records. Construction and :meth:`finish` are collective over
    ``grid.comm``; :meth:`step` is local (every rank records its own row every step).

    ``meta``: caller facts stored in meta.json (``job_name``, ``job`` dict, ``job_file``,
    ``global_batch``, ``config``, anything else JSON-able). ``resume=True`` keeps the rows and
    start time already there; rows of steps redone after the checkpoint replace the old ones
    when the records are merged. ``grid=None`` records a single process without MPI.
    """

    def __init__(self, run_dir, grid=None, meta: dict | None = None, resume: bool = False):
        self.grid = grid if grid is not None else LocalGrid()
        self.comm = self.grid.comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self.run_dir = Path(run_dir)
        self.records_dir = self.run_dir / "records"
        self._first_step_seen = False
        host = socket.gethostname()
        hosts = self.comm.allgather(host)
        error = None
        if self.rank == 0:
            try:
                self.records_dir.mkdir(parents=True, exist_ok=True)
                self._start_meta(dict(meta or {}), hosts, resume)
            except (OSError, RecordsError) as exc:
                error = f"{self.run_dir}: cannot start run records: {exc}"
        error = self.comm.bcast(error, root=0)
        if error:
            raise RecordsError(error)
        self.path = self.records_dir / f"rank-{self.rank:05d}.csv"
        if resume and self.path.exists():
            _drop_torn_tail(self.path)
        fresh = not (resume and self.path.exists() and self.path.stat().st_size > 0)
        self._file = open(self.path, "w" if fresh else "a", buffering=1)
        self._file.write(_header() if fresh else f"{_RESUME_MARK.decode()} {now_iso()}\n")
        self._file.flush()

    def _start_meta(self, user: dict, hosts: list, resume: bool) -> None:
        path = self.run_dir / "meta.json"
        previous = read_meta(self.run_dir) if resume and path.exists() else None
        start = now_iso()
        meta = dict(previous or {})
        meta.update(user)
        meta.update(_grid_facts(self.grid))
        meta.update({
            "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
            "hostnames": sorted(set(hosts)), "rank_hosts": hosts, "slurm": slurm_facts(),
            "start_time": (previous or {}).get("start_time", start), "end_time": None,
            "status": "running", "versions": package_versions(),
            "git": git_facts(user.get("job_file")),
        })
        job = user.get("job")
        meta.setdefault("job_name", job.get("name") if isinstance(job, dict) else job)
        meta["segments"] = list((previous or {}).get("segments", [])) + [
            {"start_time": start, "first_step": None}]
        write_json_atomic(path, meta)

    def step(self, **row) -> None:
        """Append this rank's row of one step (columns of :data:`COLUMNS`; ``rank`` is filled
        in, missing columns are left empty) and flush it to the OS so it survives a crash."""
        row.setdefault("rank", self.rank)
        if "step" not in row or row["step"] is None:
            raise KeyError("step record: 'step' is required")
        self._file.write(encode_row(row))
        self._file.flush()
        if self.rank == 0 and not self._first_step_seen:
            self._first_step_seen = True
            self.update_meta(lambda m: m["segments"][-1].update(first_step=int(row["step"])))

    def update_meta(self, change) -> None:
        """Rank 0 only: apply ``change(meta_dict)`` to meta.json atomically."""
        meta = read_meta(self.run_dir)
        change(meta)
        write_json_atomic(self.run_dir / "meta.json", meta)

    def close(self) -> None:
        """Local: flush and close this rank's file (error paths; no collective)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def finish(self, status: str = "ok") -> Path | None:
        """Collective: close every rank's file, merge them into steps.parquet (steps.csv
        without pyarrow), record end time and status. Returns the merged file on rank 0."""
        if status not in STATUSES[1:]:
            raise ValueError(f"finish status must be one of {STATUSES[1:]}, got {status!r}")
        self.close()
        self.comm.Barrier()
        out, error = None, None
        if self.rank == 0:
            try:
                out = merge_records(self.run_dir)
                self.update_meta(lambda m: m.update(end_time=now_iso(), status=status,
                                                    steps_file=out.name))
            except (OSError, RecordsError) as exc:
                error = f"{self.run_dir}: cannot merge run records: {exc}"
        error = self.comm.bcast(error, root=0)
        if error:
            raise RecordsError(error)
        return out


# -- the reader ------------------------------------------------------------------------------
def read_rank_file(path):
    """DataFrame of one rank file. A torn last line (crash mid-write) is dropped; after each
    resume marker, every earlier row at or past the first step recorded after the resume is
    replaced (steps redone after the checkpoint, and stale ones the crash left behind)."""
    import pandas as pd

    path = Path(path)
    data = path.read_bytes()
    first, _, rest = data.partition(b"\n")
    tag = first.decode(errors="replace")
    if not tag.startswith(_HEADER_TAG):
        raise RecordsError(f"{path}: not an hpcpar step record (first line {tag[:60]!r})")
    version = tag[len(_HEADER_TAG):].strip()
    if version != str(SCHEMA_VERSION):
        raise RecordsError(f"{path}: schema version {version}, this hpcpar reads version "
                           f"{SCHEMA_VERSION}")
    if not rest.endswith(b"\n"):
        rest = rest[: rest.rfind(b"\n") + 1]
    header, _, body = rest.partition(b"\n")
    if tuple(header.decode(errors="replace").split(",")) != COLUMN_NAMES:
        raise RecordsError(f"{path}: columns {header[:200]!r} differ from schema v"
                           f"{SCHEMA_VERSION}")
    segments = (b"\n" + body).split(b"\n" + _RESUME_MARK)
    df = None
    for rows in [segments[0]] + [seg.partition(b"\n")[2] for seg in segments[1:]]:
        part = pd.read_csv(io.BytesIO(header + b"\n" + rows.lstrip(b"\n")))
        if df is None or not len(df):
            df = part
        elif len(part):
            df = pd.concat([df[df["step"] < part["step"].min()], part], ignore_index=True)
    return df.drop_duplicates(["rank", "step"], keep="last").reset_index(drop=True)


def _sorted(df):
    return df.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def merge_records(run_dir) -> Path:
    """Merge RUN/records/rank-*.csv into RUN/steps.parquet (or RUN/steps.csv); returns it."""
    import pandas as pd

    run_dir = Path(run_dir)
    files = sorted((run_dir / "records").glob("rank-*.csv"))
    if not files:
        raise RecordsError(f"{run_dir / 'records'}: no rank-*.csv step records")
    df = _sorted(pd.concat([read_rank_file(f) for f in files], ignore_index=True))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        out = run_dir / "steps.csv"
        tmp = out.with_name(".steps.csv.tmp")
        with open(tmp, "w") as f:
            f.write(f"{_HEADER_TAG}{SCHEMA_VERSION}\n")
            df.to_csv(f, index=False, float_format=None)
    else:
        out = run_dir / "steps.parquet"
        tmp = out.with_name(".steps.parquet.tmp")
        table = pa.Table.from_pandas(df, preserve_index=False)
        meta = dict(table.schema.metadata or {})
        meta[b"hpcpar.schema_version"] = str(SCHEMA_VERSION).encode()
        pq.write_table(table.replace_schema_metadata(meta), tmp)
    os.replace(tmp, out)
    return out


def read_steps(run_dir):
    """The step table of a run: steps.parquet / steps.csv when the run finished, else the
    per-rank files (a crashed or running run). Checked against the schema version."""
    import pandas as pd

    run_dir = Path(run_dir)
    parquet, csv = run_dir / "steps.parquet", run_dir / "steps.csv"
    rank_files = sorted((run_dir / "records").glob("rank-*.csv"))
    newest_rank = max((f.stat().st_mtime for f in rank_files), default=0.0)
    if parquet.exists() and parquet.stat().st_mtime >= newest_rank:
        import pyarrow.parquet as pq

        table = pq.read_table(parquet)
        version = (table.schema.metadata or {}).get(b"hpcpar.schema_version", b"?").decode()
        if version != str(SCHEMA_VERSION):
            raise RecordsError(f"{parquet}: schema version {version}, this hpcpar reads "
                               f"version {SCHEMA_VERSION}")
        df = table.to_pandas()
    elif csv.exists() and csv.stat().st_mtime >= newest_rank:
        df = read_rank_file(csv)
    elif rank_files:
        df = _sorted(pd.concat([read_rank_file(f) for f in rank_files], ignore_index=True))
    else:
        raise RecordsError(f"{run_dir}: no step records (steps.parquet, steps.csv or "
                           f"records/rank-*.csv)")
    missing = [c for c in COLUMN_NAMES if c not in df.columns]
    if missing:
        raise RecordsError(f"{run_dir}: step records lack column(s) {missing}")
    return df[list(COLUMN_NAMES)]


def schema_markdown() -> str:
    """The step schema as a Markdown table (README and report)."""
    lines = [f"Step records, schema version {SCHEMA_VERSION}:", "",
             "| column | type | unit | meaning |", "|---|---|---|---|"]
    lines += [f"| `{c.name}` | {c.kind} | {c.unit} | {c.doc} |" for c in COLUMNS]
    return "\n".join(lines) + "\n"
