"""The run-record schema: step columns, meta.json keys, row encoding, strict JSON written
atomically, and the meta.json reader. Bump ``SCHEMA_VERSION`` on any incompatible change."""

from __future__ import annotations

import datetime as _dt
import errno
import json
import math
import numbers
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcpar._tables import text_table
from hpcpar.errors import RunDirError

if TYPE_CHECKING:
    from collections.abc import Sequence


SCHEMA_VERSION = 1
SCHEMA_NAME = "hpcpar.run"


@dataclass(frozen=True)
class Column:
    """One column of the step table: name, kind, unit (``"s"``, ``"B"``...) and ``doc``, one
    line saying what it measures."""

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
    Column("t_ckpt", "float", "s", "the step blocked on checkpointing: the copy to memory "
                                   "and waiting for the previous write ([checkpoint] background), "
                                   "or the whole write; 0 on other steps"),
    Column("skipped", "int", "-", "1 when the optimizer step was skipped on every rank (fp16 "
                                  "gradient overflow, or on_nonfinite = \"skip\"), else 0"),
    Column("loss_scale", "float", "-", "fp16 loss scale the step used, agreed by all ranks "
                                       "(empty without fp16)"),
    Column("recompute_msgs", "int", "-", "messages sent while recomputing checkpointed "
                                         "segments ([train] activation_checkpointing): 0, "
                                         "the forward's halo faces and collectives are reused"),
    Column("lr", "float", "-", "learning rate the optimizer step used (the first param "
                               "group's, as the job's schedule set it)"),
)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)
#: Columns added to schema v1 after its first release, always at the end: files written
#: without them are read with the columns empty (NaN), so older runs stay readable.
OPTIONAL_COLUMNS = ("t_halo_wait", "t_check", "t_ckpt", "skipped", "loss_scale",
                    "recompute_msgs", "lr")
#: The column lists files may have: the full one, or without the newest optional columns.
ACCEPTED_NAMES = tuple(COLUMN_NAMES[: len(COLUMN_NAMES) - i]
                        for i in range(len(OPTIONAL_COLUMNS) + 1))
KINDS = {c.name: c.kind for c in COLUMNS}

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
    "segments": "one entry per start/resume: start time, first step recorded, and the grid "
                "it ran on (grid_spec, ranks, nodes; a resume may change the grid)",
    "data": "{field: {path, checksum}} of each [data] path (path, val_path) the last segment "
            "read: sha256 of a dataset's manifest.json or of a file; a resume on other data "
            "is refused unless --new-settings",
    "diverged": "{step, reason} when status is 'diverged' (written by the training loop)",
    "versions": "python, hpcpar, torch, mpi4py, mpi_library, numba, h5py, ...",
    "git": "{commit, dirty, root} of the job file's repository, or null",
    "machine": "{cores_per_node, cores_source, ranks_per_node, threads_per_rank, "
               "oversubscribed, hosts: {host: {ranks, cores, threads}}} (machine_facts)",
    "host_load": "{before, after}: rank 0's host's [1, 5, 15]-minute load averages when the "
                 "records start (before the first step of this segment; the ranks' own start "
                 "barely counts) and when they finish (the run's own ranks count), or null",
}

STATUSES = ("running", "ok", "preempted", "failed", "diverged")
HEADER_TAG = f"# {SCHEMA_NAME} steps schema_version="


def now_iso() -> str:
    """The current UTC time, ISO 8601 with milliseconds."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


# -- row encoding ----------------------------------------------------------------------------
def _cell(name: str, value) -> str:
    if value is None:
        return ""
    if KINDS[name] == "int":
        if isinstance(value, float) and value != value:
            return ""
        return str(int(value))
    return repr(float(value))  # shortest text that reads back to the same double


def encode_row(row: dict, names: Sequence[str] = COLUMN_NAMES) -> str:
    """A step row (column name -> value; missing columns left empty) as one CSV line with its
    newline, in the file's columns ``names`` (a file begun before an optional column existed
    keeps its own columns on resume; values of columns it lacks are not written). A column not
    in the schema is a bug: KeyError."""
    unknown = set(row) - set(COLUMN_NAMES)
    if unknown:
        raise KeyError(f"step record: unknown column(s) {sorted(unknown)}; schema v"
                       f"{SCHEMA_VERSION} has {', '.join(COLUMN_NAMES)}")
    return ",".join(_cell(n, row.get(n)) for n in names) + "\n"


def file_columns(path: Path) -> tuple:
    """The columns of an existing rank file (rows appended on resume keep to them)."""
    with open(path, "rb") as f:
        line = f.readline()
        if line.startswith(HEADER_TAG.encode()):  # a file written before 0.2: a tag line
            line = f.readline()
    names = tuple(line.decode(errors="replace").strip().split(","))
    return names if names in ACCEPTED_NAMES else COLUMN_NAMES


def header_line() -> str:
    """The first line of a rank file: the column names, so ``pandas.read_csv(path)`` reads it
    as it is (the schema version is in meta.json)."""
    return ",".join(COLUMN_NAMES) + "\n"


def drop_torn_tail(path: Path) -> None:
    """Cut a last line that a crash left without its newline (so appends start clean)."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+", opener=open_nofollow) as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)


def strict_json(obj: Any) -> Any:
    """A copy of nested dicts, lists and scalars that dumps as strict JSON (``allow_nan=False``)
    any parser reads: NaN/inf floats as None (JSON ``null``), numpy scalars as Python numbers."""
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, numbers.Number) and not isinstance(obj, int) and hasattr(obj, "item"):
        return strict_json(obj.item())  # numpy scalar
    return obj


def oserror_text(exc: OSError) -> str:
    return exc.strerror or str(exc)


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """``os.open`` of a run file that never follows a symbolic link placed at ``path`` (a link
    in a run directory must not make hpcpar append to or truncate its target); usable as
    ``open(path, "a", opener=open_nofollow)``. A link raises a one-line RunDirError; any other
    failure to open, OSError."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise RunDirError(f"{path}: a symbolic link; hpcpar writes no run file through a link "
                          f"(remove it)") from None


def read_regular(path: str | os.PathLike, limit: int = 1 << 28) -> bytes:
    """The bytes of a regular file: a FIFO or a device named like a run file is refused
    instead of read (reading a FIFO blocks until someone writes to it), as is one larger than
    ``limit`` bytes (RunDirError); OSError when it cannot be opened (FileNotFoundError when
    missing)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunDirError(f"{path}: not a regular file (hpcpar reads only files it wrote)")
        if st.st_size > limit:
            raise RunDirError(f"{path}: {st.st_size} bytes, larger than any hpcpar record "
                              f"({limit})")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` as strict JSON (NaN/inf as null, see ``strict_json``) atomically: a
    temporary file, fsync, then rename, so readers see the old or the new file, never half of
    one. An OSError (disk full, permissions) becomes a RunDirError naming the file; the old
    file is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    text = json.dumps(strict_json(obj), indent=2, sort_keys=True, default=str,
                      allow_nan=False) + "\n"
    try:
        with open(tmp, "w", opener=open_nofollow) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise RunDirError(f"{path}: cannot write ({oserror_text(exc)}); the previous version, if "
                          f"any, is unchanged") from None


def read_meta(run_dir: str | os.PathLike) -> dict:
    """A run's meta.json, checked for schema name and version; RunDirError when missing or
    unreadable, or of another schema or version."""
    path = Path(run_dir) / "meta.json"
    try:
        meta = json.loads(read_regular(path))
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


def schema_markdown() -> str:
    """The step schema as a Markdown table (README and report)."""
    rows = [(f"`{c.name}`", c.kind, c.unit, c.doc) for c in COLUMNS]
    return (f"Step records, schema version {SCHEMA_VERSION}:\n\n"
            + text_table(("column", "type", "unit", "meaning"), rows) + "\n")
