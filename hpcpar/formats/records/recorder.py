"""The writer: ``RunRecorder`` appends one CSV row per rank per step and merges the ranks at
finish; ``LocalGrid``/``LocalComm`` let it record without MPI (synthetic and example runs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcpar.errors import RunDirError
from hpcpar.formats.records.facts import (
    git_facts,
    host_load,
    machine_facts,
    package_versions,
    rank_machine_facts,
    slurm_facts,
)
from hpcpar.formats.records.reader import merge_records
from hpcpar.formats.records.schema import (
    COLUMN_NAMES,
    KINDS,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    STATUSES,
    drop_torn_tail,
    encode_row,
    file_columns,
    header_line,
    now_iso,
    open_nofollow,
    oserror_text,
    read_meta,
    write_json_atomic,
)
from hpcpar.parallel.agree import agree

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from hpcpar.parallel.grid import ProcessGrid


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
    """Grid facts for a recorder without MPI: ``shape`` ``(data, x, y, z)``, the rank this
    process records as, and the number of nodes to record."""

    def __init__(self, shape: Sequence[int] = (1, 1, 1, 1), rank: int = 0, nodes: int = 1):
        self.shape = tuple(shape)
        self.size = self.shape[0] * self.shape[1] * self.shape[2] * self.shape[3]
        self.rank, self.num_nodes = rank, nodes
        self.comm = LocalComm(rank, self.size)


def row_from_counters(delta: dict) -> dict:
    """The step columns among counter differences (``Counters.since`` of
    :mod:`hpcpar.parallel.counters`); graph halos count as halo time."""
    row = {k: v for k, v in delta.items() if k in KINDS}
    if "t_graph_halo" in delta:
        row["t_halo"] = row.get("t_halo", 0.0) + delta["t_graph_halo"]
    return row


def _with_load_after(meta: dict) -> dict:
    """meta.json ``host_load`` with the load at finish added (``before`` as the start wrote
    it; None for records begun before the key existed)."""
    before = meta.get("host_load")
    return {"before": before.get("before") if isinstance(before, dict) else None,
            "after": host_load()}


# -- the writer ------------------------------------------------------------------------------
class RunRecorder:
    """Writes one run's records: ``meta.json`` and one CSV row per rank per step, merged into
    ``steps.parquet`` at the end (format: ``docs/guides/analysis.md``).

    Construction and [finish][hpcpar.formats.records.RunRecorder.finish] are collective over
    ``grid.comm``; [step][hpcpar.formats.records.RunRecorder.step] is local (every rank records
    its own row every step). Rows go to ``run_dir/records``; ``grid=None`` records a single
    process without MPI. ``meta`` holds the caller's facts for meta.json (``job_name``, ``job``
    dict, ``job_file``, ``global_batch``, ``config``, anything else JSON-able). ``resume`` keeps
    the rows and start time already there; rows of steps redone after the checkpoint replace the
    old ones when the records are merged. When rank 0 cannot create the records or read the
    existing meta.json, every rank raises the same RunDirError.

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

        def start() -> None:
            try:
                self.records_dir.mkdir(parents=True, exist_ok=True)
                self._start_meta(dict(meta or {}), hosts, resume, machine_facts(facts))
            except RunDirError as exc:
                raise RunDirError(f"{self.run_dir}: cannot start run records: {exc}") from None
            except OSError as exc:
                raise RunDirError(f"{exc.filename or self.run_dir}: cannot start run records "
                                  f"({oserror_text(exc)})") from None

        agree(self.comm, start, root=0)
        self.path = self.records_dir / f"rank-{self.rank:05d}.csv"
        if resume and self.path.exists():
            drop_torn_tail(self.path)
        fresh = not (resume and self.path.exists() and self.path.stat().st_size > 0)
        self._names = COLUMN_NAMES if fresh else file_columns(self.path)
        try:
            self._fd: int | None = open_nofollow(self.path, os.O_WRONLY | os.O_CREAT
                                                 | os.O_APPEND | (os.O_TRUNC if fresh else 0))
        except OSError as exc:
            raise RunDirError(f"{self.path}: cannot open step records ({oserror_text(exc)})") \
                from None
        self._complete = os.lseek(self._fd, 0, os.SEEK_END)  # bytes in whole lines
        if fresh:
            self._write(header_line())

    def _write(self, text: str) -> None:
        """Append whole lines: one ``write`` (retried on short writes). On any OSError (disk
        full, quota, I/O error) the file is cut back to its last complete line and one
        :class:`RunDirError` names it: a torn line is never left behind."""
        fd = self._fd
        assert fd is not None, f"{self.path}: step records written after close()"
        data = memoryview(text.encode())
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as exc:
            try:
                os.ftruncate(fd, self._complete)
            except OSError:
                pass
            raise RunDirError(f"{self.path}: cannot write step records ({oserror_text(exc)}); "
                              f"the records up to the last complete step are kept") from None
        self._complete += len(text.encode())

    def _start_meta(self, user: dict, hosts: list, resume: bool, machine: dict) -> None:
        path = self.run_dir / "meta.json"
        previous = read_meta(self.run_dir) if resume and path.exists() else None
        start = now_iso()
        meta = dict(previous or {})
        meta.pop("end_reason", None)        # a new segment: the last one's ending is history
        meta.update(user)
        grid = _grid_facts(self.grid)
        meta.update(grid)
        meta.update({
            "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
            "hostnames": sorted(set(hosts)), "rank_hosts": hosts, "slurm": slurm_facts(),
            "start_time": (previous or {}).get("start_time", start), "end_time": None,
            "status": "running", "versions": package_versions(),
            "git": git_facts(user.get("job_file")), "machine": user.get("machine", machine),
            "host_load": user.get("host_load", {"before": host_load(), "after": None}),
        })
        job = user.get("job")
        meta.setdefault("job_name", job.get("name") if isinstance(job, dict) else job)
        meta["segments"] = list((previous or {}).get("segments", [])) + [
            {"start_time": start, "first_step": None, "grid_spec": grid["grid_spec"],
             "ranks": grid["ranks"], "nodes": grid["nodes"]}]
        write_json_atomic(path, meta)

    def step(self, **row: Any) -> None:
        """Append this rank's row of one step (``COLUMNS``; ``rank`` filled in, missing columns
        left empty) and flush it to the OS, so it survives a crash. A row that cannot be written
        (disk full...) raises RunDirError and leaves no torn line."""
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
        """Apply ``change(meta_dict)``, which modifies it in place, to meta.json atomically
        (rank 0 only)."""
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
        """Close every rank's file, merge them, and record the end time, the final ``status``
        (one of ``STATUSES`` but "running") and ``reason`` as ``end_reason`` (None removes an
        earlier one). Collective; returns the merged ``steps.parquet`` on rank 0, else None."""
        if status not in STATUSES[1:]:
            raise ValueError(f"finish status must be one of {STATUSES[1:]}, got {status!r}")
        self.close()
        self.comm.Barrier()

        def merge() -> Path:
            try:
                out = merge_records(self.run_dir)
                self.update_meta(lambda m: m.update(end_time=now_iso(), status=status,
                                                    end_reason=reason, steps_file=out.name,
                                                    host_load=_with_load_after(m)))
            except RunDirError as exc:
                raise RunDirError(f"{self.run_dir}: cannot merge run records: {exc}") from None
            except OSError as exc:  # disk full while writing steps.parquet: rank files stay
                raise RunDirError(f"{exc.filename or self.run_dir}: cannot merge run records "
                                  f"({oserror_text(exc)}); records/rank-*.csv are kept") from None
            return out

        out = agree(self.comm, merge, root=0)
        return out if self.rank == 0 else None
