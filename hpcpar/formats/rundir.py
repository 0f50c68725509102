"""Who owns a run directory, and whether a rerun may continue in it.

``hpcpar run`` holds ``RUN/hpcpar.lock`` (JSON: host, pid, the pid's start time, since when)
while its ranks run, so a second run into a busy directory is refused with one line instead of
interleaving records. A lock whose holder is gone (same host, pid not running or reused; or an
earlier incarnation of the same requeued Slurm job, on any node) is stale: it is taken over
with a warning. A lock held from another host cannot be checked: it is refused, naming the host
and pid (delete the file if that run is gone).

A rerun continues the run in the directory only with the same settings: the resolved job is
compared with ``RUN/job.json`` key by key, and a difference is refused naming the keys, before
anything in the directory changes. Keys that do not change what is computed
(:data:`RESUME_FREE`: logging, checkpoint cadence, resources) may differ. ``--new-settings``
resumes with the new settings anyway (a new segment; the old job.json is kept beside it), and
``--fresh`` moves hpcpar's own files (:data:`RUN_ENTRIES`) into ``previous-<time>/`` (nothing is
deleted; anything else in the directory stays where it is) and starts over. A rerun of a finished
run (meta.json status "ok") with the same settings changes nothing.

Only hpcpar's own directories are used: a directory that is not empty must be a run directory
(:func:`check_run_dir`), so ``--run-dir .`` in a project folder is refused before anything in it
changes. What makes one is its mark, ``RUN/hpcpar-run.json`` (:data:`MARK_NAME`): written only
by the lock's holder into a directory it was allowed to use, it holds the directory's run id
(the lock records it too) and the names that are hpcpar's there, the only entries ``--fresh``
moves. A ``job.json``, a ``meta.json`` or a lock file alone marks nothing: anyone can write one
(``hpcpar run --print-config --json > job.json``). Sweeps lock (and mark) their output directory
with the same :class:`RunLock`.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import filelock

from hpcpar.errors import HpcparError, RunDirError
from hpcpar.formats.jobspec import build_job
from hpcpar.formats.records import SCHEMA_NAME, SCHEMA_VERSION, now_iso, write_json_atomic

__all__ = ["LOCK_NAME", "MARK_NAME", "RESUME_FREE", "RUN_ENTRIES", "RunLock", "read_mark",
           "write_mark", "owned_dir", "read_json_file", "make_run_dir", "check_run_dir",
           "describe_diff", "check_settings", "finished_status", "move_aside", "check_fresh",
           "keep_old_settings", "set_aside_result", "ended", "mark_ended", "resumed_from"]

LOCK_NAME = "hpcpar.lock"
#: the mark of a directory hpcpar owns (a run's or a sweep's): JSON, see :func:`write_mark`
MARK_NAME = "hpcpar-run.json"
MARK_SCHEMA = "hpcpar.owned-dir"
#: job keys that may change between the segments of one run: they do not change what is
#: trained (the data width changes only the rounding, e.g. a job that lost a node resumes on
#: fewer; checkpoints are independent of it)
RESUME_FREE = ("job.description", "grid.data", "train.log_every", "train.val_every",
               "checkpoint.every", "checkpoint.keep", "checkpoint.at_end",
               "checkpoint.background", "resources.*",
               "output.dir", "data.prefetch", "data.stage_to", "data.verify")


#: what hpcpar itself writes into a run directory (names and patterns): ``--fresh`` moves these
#: and nothing else (the lock and earlier ``previous-*`` folders stay)
RUN_ENTRIES = ("job.json", "job.toml", "job.next.json", "job-*.json", "job-*.toml", "meta.json",
               "metrics.json", "steps.parquet", "steps.csv", "records", "checkpoints", "logs",
               "profile", "tensorboard", ".*.tmp*")


#: the files of a run directory that hpcpar reads or replaces whole: each must be a regular file
#: (a FIFO would block its reader, a link or a directory is not hpcpar's)
RUN_FILES = ("job.json", "job.toml", "job.next.json", "meta.json", "metrics.json")


def _own(name: str, patterns=RUN_ENTRIES) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def read_json_file(path: Path) -> dict:
    """A small JSON object read from a regular file (never a FIFO or a device: reading one
    could block forever), ``{}`` when it is anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        data = json.loads(os.read(fd, 1 << 20))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else {}


def read_mark(d: str | os.PathLike, what: str = "run") -> dict | None:
    """The mark (``run_id``, ``what``, ``entries``...) of a directory hpcpar owns as ``what``
    (``"run"`` or ``"sweep"``): ``d/hpcpar-run.json`` when it is one of ``what``, else None."""
    mark = read_json_file(Path(d) / MARK_NAME)
    ok = (mark.get("schema") == MARK_SCHEMA and mark.get("what") == what
          and isinstance(mark.get("run_id"), str) and isinstance(mark.get("entries"), list))
    return mark if ok else None


def write_mark(d: str | os.PathLike, what: str, run_id: str, entries=RUN_ENTRIES) -> None:
    """Mark ``d`` as a directory hpcpar owns as ``what`` (``"run"`` or ``"sweep"``), with its id
    (the lock records it too) and the name patterns of the entries that are hpcpar's there.
    Call only holding its lock, after the directory was found new, empty or already hpcpar's."""
    write_json_atomic(Path(d) / MARK_NAME, {
        "schema": MARK_SCHEMA, "what": what, "run_id": run_id, "created": now_iso(),
        "entries": list(entries)})


def owned_entries(d: str | os.PathLike, what: str = "run", patterns=RUN_ENTRIES) -> tuple:
    """The name patterns of ``d``'s entries that are hpcpar's: those its mark lists (only
    ever a subset of ``patterns``), or ``patterns`` for a directory without a mark (made by
    an older hpcpar: :func:`is_run_dir` accepted it only when nothing else is in it)."""
    mark = read_mark(d, what)
    if mark is None:
        return tuple(patterns)
    return tuple(p for p in patterns if p in mark["entries"])


def _empty(p: Path) -> bool:
    try:
        return not any(p.iterdir()) if p.is_dir() else p.lstat().st_size == 0
    except OSError:
        return False


def owned_dir(d: Path, what: str, patterns, legacy: Callable[[Path], bool]) -> bool:
    """Whether hpcpar may use directory ``d`` as ``what``: empty (or holding only empty
    entries of hpcpar's own names, e.g. a ``records/`` mount point, and a lock), marked as
    ``what`` (:func:`read_mark`), or made by an hpcpar before the mark: ``legacy(d)`` holds and
    every entry has one of hpcpar's names (``patterns``, the lock, ``previous-*``)."""
    entries = list(d.iterdir())
    if all(p.name == LOCK_NAME or (_own(p.name, patterns) and _empty(p)) for p in entries):
        return True
    if read_mark(d, what) is not None:
        return True
    old = (*patterns, LOCK_NAME, "previous-*")
    return all(_own(p.name, old) for p in entries) and legacy(d)


def _old_run(d: Path) -> bool:
    return (read_json_file(d / "meta.json").get("schema") == SCHEMA_NAME
            and isinstance(read_json_file(d / "job.json").get("job"), dict))


def is_run_dir(run_dir: str | os.PathLike) -> bool:
    """Whether hpcpar may use a directory as a run directory: empty (or holding only empty
    entries of hpcpar's own names, e.g. a ``records/`` mount point), marked as one
    (``hpcpar-run.json``, which only ``hpcpar run`` writes), or a run directory of an hpcpar
    before the mark (meta.json of schema ``hpcpar.run``, job.json holding the resolved job,
    and nothing but hpcpar's own entries)."""
    return owned_dir(Path(run_dir), "run", RUN_ENTRIES, _old_run)


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """Refuse (read-only) an existing directory that hpcpar did not make as a run directory:
    RunDirError when it is not empty and not a run directory (named, with an entry of it), or
    one of its :data:`RUN_FILES` is not a regular file."""
    if is_run_dir(run_dir):
        for name in RUN_FILES:
            path = Path(run_dir) / name
            if path.is_symlink() or (path.exists() and not path.is_file()):
                what = "a symbolic link" if path.is_symlink() else \
                    "a directory" if path.is_dir() else "not a regular file"
                raise RunDirError(f"{path}: {what}, where hpcpar keeps a file of the run; "
                                  f"move it away, or choose another --run-dir")
        return
    names = sorted(p.name for p in Path(run_dir).iterdir())
    raise RunDirError(f"--run-dir {run_dir}: not a run directory (it holds {names[0]!r}"
                      + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                      + f" and no {MARK_NAME}, which hpcpar run writes); choose a new or empty "
                        f"directory")


def make_run_dir(run_dir: str | os.PathLike) -> None:
    """Create the run directory (and its parents) when missing; one-line RunDirError when it
    cannot be (a read-only file system, permissions)."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"--run-dir {run_dir}: cannot create it "
                          f"({exc.strerror or exc})") from None


# -- the lock -------------------------------------------------------------------------------
def _pid_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (/proc; None elsewhere or when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_running(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start is not None and Path("/proc").is_dir():
        return _pid_start(pid) == start     # a reused pid is another process
    return True


#: errors of ``flock`` on a file system that has no such lock (some network mounts)
_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


def _slurm_incarnation() -> tuple[str | None, str]:
    """(SLURM_JOB_ID, SLURM_RESTART_COUNT): a requeued job keeps its id, counts up restarts."""
    return os.environ.get("SLURM_JOB_ID") or None, os.environ.get("SLURM_RESTART_COUNT", "0")


class RunLock:
    """``DIR/hpcpar.lock``: :meth:`acquire` or a :class:`RunDirError`; :meth:`release`.

    The holder marks the directory as hpcpar's (:func:`write_mark`, listing ``entries``, the
    name patterns of what it writes there) and records its run id in the lock: call
    :meth:`acquire` only on a directory found new, empty or hpcpar's. ``warn`` prints the
    warning about a stale lock taken over; ``what`` (``"run"``, or ``"sweep"`` for a sweep's
    ``--out``) and ``option`` (the one that chooses another directory) are named in a refusal.
    """

    def __init__(self, run_dir: str | os.PathLike, warn: Callable[[str], object] = print,
                 what: str = "run", option: str = "--run-dir", entries=RUN_ENTRIES):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.warn = warn
        self.what, self.option, self.entries = what, option, tuple(entries)
        self.held = False
        self.run_id: str | None = None
        self._flock: filelock.FileLock | None = None

    def holder(self) -> dict | None:
        """The lock's contents; ``{}`` for an unreadable lock, None when there is none."""
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def _stale(self, holder: dict) -> bool:
        if not holder:      # unreadable: stale unless it is being written right now
            try:
                return time.time() - self.path.stat().st_mtime > 10
            except OSError:
                return True
        job, restart = _slurm_incarnation()
        if job and holder.get("slurm_job") == job and holder.get("slurm_restart") != restart:
            return True     # an earlier incarnation of this requeued Slurm job: it is gone
        if holder.get("host") != socket.gethostname():
            return False
        return not _pid_running(int(holder.get("pid", -1)), holder.get("pid_start"))

    def _busy(self, holder: dict) -> RunDirError:
        where = holder.get("host", "?")
        other = "" if where == socket.gethostname() else \
            f" (another host: if that run is gone, delete {self.path})"
        what = holder.get("what") if holder.get("what") in ("run", "sweep") else "run"
        return RunDirError(f"{self.run_dir}: in use by another hpcpar "
                           f"{what} (pid {holder.get('pid', '?')} on {where} "
                           f"since {holder.get('since', '?')}){other}; wait for it, or use "
                           f"another {self.option}")

    def check(self) -> None:
        """Read-only: raise when a live run holds the lock (a stale lock is no obstacle)."""
        holder = self.holder()
        if holder is not None and not self._stale(holder):
            raise self._busy(holder)

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirError` naming who holds it.

        ``filelock`` holds a kernel lock on the file for as long as the run lasts, so two
        claims on this host never both win (a stale lock is taken over by one of them) and a
        holder that dies releases it; the JSON inside names the holder, and decides for a
        holder the kernel lock cannot see (another host, an earlier Slurm incarnation).
        """
        self._flock = filelock.FileLock(self.path, timeout=0, thread_local=False,
                                        fallback_to_soft=False, on_acquired=self._claim)
        try:
            self._flock.acquire()
        except filelock.Timeout:
            raise self._busy(self.holder() or {}) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise RunDirError(f"{self.path}: cannot lock ({exc.strerror or exc})") from None
            self._flock = None      # a file system without flock: the JSON alone decides
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                self._claim(fd)
            finally:
                os.close(fd)
        self.held = True

    def _claim(self, fd: int) -> None:
        """Under the kernel lock: refuse a live holder the JSON names, else write ours."""
        try:
            holder = json.loads(os.pread(fd, 1 << 16, 0) or b"null")
        except ValueError:
            holder = {}
        if holder is not None:
            holder = holder if isinstance(holder, dict) else {}
            if not self._stale(holder):
                raise self._busy(holder)
            self.warn(f"hpcpar: warning: {self.path}: taking over a stale lock (pid "
                      f"{holder.get('pid', '?')} on {holder.get('host', '?')} is not running)")
        job, restart = _slurm_incarnation()
        mark = read_mark(self.run_dir, self.what)
        self.run_id = mark["run_id"] if mark is not None else uuid.uuid4().hex
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(
            os.getpid()), "since": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv,
            "slurm_job": job, "slurm_restart": restart, "what": self.what,
            "run_id": self.run_id}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        if mark is None:
            write_mark(self.run_dir, self.what, self.run_id, self.entries)

    def release(self) -> None:
        """Remove the lock file (when it is still this process's) and drop the kernel lock."""
        if self.held:
            self.held = False
            holder = self.holder()
            if holder and holder.get("pid") == os.getpid():
                try:
                    os.unlink(self.path)    # before unlocking: nobody else holds it meanwhile
                except FileNotFoundError:
                    pass
            if self._flock is not None:
                self._flock.release()


# -- settings -------------------------------------------------------------------------------
def _flat(job: dict) -> dict:
    """{"section.key": value} of a job dict, JSON-normalised (tuples as lists)."""
    job = json.loads(json.dumps(job, default=str))
    return {f"{sec}.{k}": v for sec, values in job.items() if isinstance(values, dict)
            for k, v in values.items()}


def _free(key: str) -> bool:
    return any(key == f or (f.endswith(".*") and key.startswith(f[:-1])) for f in RESUME_FREE)


def settings_diff(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, old value, new value) of every result-changing setting (not ``RESUME_FREE``) that
    differs between the job dict a run started with and this start's, sorted by key, to refuse
    a silent change; an unset value is a placeholder object."""
    a, b = _flat(old), _flat(new)
    missing = object()
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing) and not _free(k)]


def describe_diff(diff: list[tuple[str, object, object]]) -> str:
    """:func:`settings_diff`'s differences in one line for an error message: ``key old -> new``
    each, comma-separated; an unset value reads ``(unset)``."""
    def show(v):
        return "(unset)" if not isinstance(v, (str, int, float, bool, list, dict, type(None))) \
            else json.dumps(v)
    return ", ".join(f"{k} {show(a)} -> {show(b)}" for k, a, b in diff)


def check_settings(run_dir: str | os.PathLike, job: dict) -> list:
    """Compare the resolved job dict of this start with the settings the run directory was
    started with, before resuming it: :func:`settings_diff`'s differences, [] when there is no
    ``job.json`` yet.

    Keys added to hpcpar since ``job.json`` was written count at their defaults. An unreadable
    ``job.json`` raises RunDirError and is never overwritten.
    """
    path = Path(run_dir) / "job.json"
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())["job"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunDirError(f"{path}: unreadable ({exc}); restore it, or start over with "
                          f"--fresh (moves the old files aside)") from None
    return settings_diff(_with_new_defaults(old), job)


def _with_new_defaults(old: dict) -> dict:
    """A job.json written before keys were added gets their defaults (a key this hpcpar
    added is not a changed setting); left as it is when it no longer validates."""
    try:
        return build_job(old, untrusted=True).to_dict()  # never import its kind's module
    except (HpcparError, TypeError, AttributeError):
        return old


def finished_status(run_dir: str | os.PathLike) -> dict | None:
    """A run's meta.json when its status is "ok", else None (also when unreadable): tells a
    finished run from one to resume."""
    try:
        meta = json.loads((Path(run_dir) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("status") == "ok" else None


def resumed_from(run_dir: str | os.PathLike) -> tuple[str, int] | None:
    """(checkpoint name, step) the ranks of the latest segment resumed from, as meta.json
    records it; None for a start from step 0 (or no record)."""
    try:
        seg = json.loads((Path(run_dir) / "meta.json").read_text())["segments"][-1]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    if seg.get("resumed_from"):
        return str(seg["resumed_from"]), int(seg.get("resumed_step", 0))
    return None


# -- changing the directory (only after the lock is held) -----------------------------------
def move_aside(run_dir: str | os.PathLike, keep=()) -> Path | None:
    """``--fresh``: move hpcpar's own files of a run directory into ``previous-<time>/``.

    Only the entries the directory's mark lists as hpcpar's (:func:`owned_entries`) are moved:
    the mark, the lock, earlier ``previous-*`` folders, ``keep`` (the job file being run, when
    it is ``RUN/job.toml``) and anything else (a user's notes or code) stay in place. Call only
    while holding the lock. Returns the ``previous-*`` folder, None when nothing moved.
    """
    run_dir = Path(run_dir)
    kept = {Path(k).resolve() for k in keep}
    own = owned_entries(run_dir)
    old = [p for p in sorted(run_dir.iterdir())
           if _own(p.name, own) and p.resolve() not in kept]
    if not old:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = run_dir / f"previous-{stamp}", 1
    while dest.exists():
        n += 1
        dest = run_dir / f"previous-{stamp}-{n}"
    dest.mkdir()
    for p in old:
        os.rename(p, dest / p.name)
    return dest


def check_fresh(run_dir: str | os.PathLike, job_file: str | os.PathLike) -> None:
    """Refuse (read-only) a ``--fresh`` that would move the job file being run aside: one
    inside an entry :func:`move_aside` moves (``RUN/records/job.toml``; ``RUN/job.toml``
    itself stays); the RunDirError names the job file and the entry."""
    run_dir, src = Path(run_dir).resolve(), Path(job_file).resolve()
    if not src.is_relative_to(run_dir) or src.parent == run_dir:
        return
    top = run_dir / src.relative_to(run_dir).parts[0]
    if _own(top.name, owned_entries(run_dir)):
        raise RunDirError(f"{job_file}: --fresh moves {top.name}/ of {run_dir} aside, this "
                          f"job file with it; copy it out of the run directory first")


def keep_old_settings(run_dir: str | os.PathLike, result: Path | None = None) -> Path | None:
    """``--new-settings``: copy job.json to ``job-<time>.json`` before it is replaced; None when
    there is none. With ``result`` (these settings' result set aside, :func:`set_aside_result`)
    the copy takes its time, so the two read as a pair."""
    src = Path(run_dir) / "job.json"
    if not src.exists():
        return None
    name = result.name.replace(_RESULT_SUFFIX, ".json") if result is not None else \
        f"job-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dest = src.with_name(name)
    dest.write_bytes(src.read_bytes())
    return dest


#: ``job-<time>.metrics.json``: an earlier segment's metrics.json, beside the settings that
#: produced it (``job-<time>.json``); a ``job-*.json`` name, so hpcpar's own (``--fresh``
#: moves it) in every marked directory
_RESULT_SUFFIX = ".metrics.json"


def set_aside_result(run_dir: str | os.PathLike) -> Path | None:
    """Before the ranks start a segment: move ``metrics.json`` to ``job-<time>.metrics.json``.

    A run that starts a segment has not finished (a finished one with its own settings is not
    run again), so its metrics.json is an earlier result: of other settings (``--new-settings``)
    or of a history ``--from`` replaces. Left in place it would outlive a segment that stops or
    fails and claim the run finished. Call only while holding the lock. Returns the new name,
    None when there is no metrics.json.
    """
    src = Path(run_dir) / "metrics.json"
    if not src.is_file():
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    dest = src.with_name(f"job-{stamp}{_RESULT_SUFFIX}")
    while dest.exists() or dest.with_name(f"{dest.name[:-len(_RESULT_SUFFIX)]}.json").exists():
        n += 1
        dest = src.with_name(f"job-{stamp}-{n}{_RESULT_SUFFIX}")
    os.replace(src, dest)
    return dest


def ended(meta: dict) -> bool:
    """Whether meta.json records how the run ended: not "running", and not a stop a signal
    asked for that the ranks have not completed yet (status "preempted" without an end time,
    written the moment the signal arrived, see :mod:`hpcpar.run.trainer`)."""
    status = meta.get("status")
    return status != "running" and not (status == "preempted" and meta.get("end_time") is None)


def mark_ended(run_dir: str | os.PathLike, reason: str, status: str = "failed",
               job: dict | None = None, final: bool = True) -> None:
    """Record how a run ended when its ranks could not (killed, crashed, stopped by a signal).

    A meta.json that has not recorded an ending (:func:`ended`) gets ``status`` (``"failed"``,
    or ``"preempted"`` for a stop a signal asked for), ``end_reason`` (one line) and an end time
    (none when not ``final``: a stop under way, which the ranks' own ending or a later failure
    still replaces); one that has is left as it is. A missing meta.json is written (a run that
    failed before its records started) only when the resolved ``job`` dict is given; an
    unreadable one is left.
    """
    path = Path(run_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        if job is None or not Path(run_dir).is_dir():
            return
        meta = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
                "job_name": job.get("name"), "job": job, "start_time": now_iso(),
                "segments": [], "status": "running"}
    except (OSError, ValueError):
        return
    if not isinstance(meta, dict) or ended(meta):
        return
    meta.update(status=status, end_reason=reason, end_time=now_iso() if final else None)
    try:
        write_json_atomic(path, meta)
    except RunDirError:
        pass        # the disk that failed the run may refuse this too: the old file stays
