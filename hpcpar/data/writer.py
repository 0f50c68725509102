"""Writing a dataset directory in parallel, all or nothing.

Shards are split over the ranks with the partition rule; each rank writes its own shards into a
hidden temporary directory next to ``OUT``; rank 0 writes the manifest and renames the directory to
``OUT`` only when every rank succeeded. A failure on any rank removes the temporary directory, so
``OUT`` is either complete or absent. Sources provide ``x_shape``, ``y_shape``, dtypes, ``attrs``
and ``read(start, stop) -> (x, y)``."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from hpcpar import _env
from hpcpar.errors import DataError
from hpcpar.parallel.agree import agree
from hpcpar.parallel.partition import part_range

if TYPE_CHECKING:
    from mpi4py import MPI

    from .synthetic import CosmoflowSource
    from .volume_files import VolumeFiles
from hpcpar.parallel.partition import split_sizes

from .format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TRANSFORMS,
    Array,
    Manifest,
    PerRankChunks,
    Shard,
    check_file,
    dataset_stats,
    merge_stats,
    open_h5,
    read_manifest,
    sha256_file,
    shard_name,
    value_stats,
    x_chunks,
)

__all__ = ["SerialComm", "shard_counts", "write_dataset", "reserve_space", "oserror_line",
           "H5Source"]

BLOCK_BYTES = 64 << 20  # samples are read from the source in blocks of about this size


class SerialComm:
    """The few communicator calls the writer makes, for one process without MPI."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def gather(self, obj, root=0):
        return [obj]

    def Barrier(self) -> None:
        pass


def shard_counts(samples: int, shards: int | None = None,
                 samples_per_shard: int | None = None) -> list[int]:
    """Samples per shard, in order: ``shards`` balanced ones (the partition rule), or, given
    ``samples_per_shard``, shards of that size (the last one may be smaller). DataError for no
    samples, or a shard count or size out of range."""
    if samples < 1:
        raise DataError(f"--samples: need at least 1 sample, got {samples}")
    if samples_per_shard is not None:
        if samples_per_shard < 1:
            raise DataError(f"--samples-per-shard: must be positive, got {samples_per_shard}")
        full, rest = divmod(samples, samples_per_shard)
        return [samples_per_shard] * full + ([rest] if rest else [])
    if shards is None or not 1 <= shards <= samples:
        raise DataError(f"--shards: must be between 1 and the {samples} samples, got {shards}")
    return split_sizes(samples, shards)


def _block_stats(source, start: int, block: dict, allow_nonfinite: bool) -> dict:
    """value_stats of each key of one block; NaN/inf is an error naming the first bad sample
    unless ``allow_nonfinite`` (then the manifest records ``finite: false``)."""
    out = {}
    for key, arr in block.items():
        st = value_stats(arr)
        if st["nonfinite"] and not allow_nonfinite:
            flat = np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)
            bad = start + int(np.argmin(flat))
            what = getattr(source, "name", None) or type(source).__name__
            key = getattr(source, "keys", {}).get(key, key)
            raise DataError(f"{what}: sample {bad}: '{key}' holds NaN/inf values (a dataset "
                            f"must be finite to train; --allow-nonfinite keeps them)")
        out[key] = st
    return out


def _write_shard(path: str, source, index: int, start: int, count: int, total: int,
                 nshards: int, chunk, progress, allow_nonfinite: bool = False) -> dict:
    """Write one shard; returns its ``{"x": value_stats, "y": value_stats}``."""
    import h5py

    sample_bytes = int(np.prod(source.x_shape)) * np.dtype(source.x_dtype).itemsize
    block = max(1, BLOCK_BYTES // max(sample_bytes, 1))
    with h5py.File(path, "w") as f:
        f.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION,
                        "shard_index": index, "num_shards": nshards, "sample_start": start,
                        "sample_stop": start + count, "num_samples": total})
        dx = f.create_dataset("x", shape=(count, *source.x_shape), dtype=source.x_dtype,
                              chunks=x_chunks(source.x_shape, chunk), track_times=False)
        dx.attrs["axes"] = "NCDHW"
        dy = f.create_dataset("y", shape=(count, *source.y_shape), dtype=source.y_dtype,
                              chunks=y_chunks(source, chunk), track_times=False)
        if source.target_names:
            dy.attrs["names"] = list(source.target_names)
        stats: dict = {"x": None, "y": None}
        for a in range(0, count, block):
            b = min(count, a + block)
            x, y = source.read(start + a, start + b)
            got = _block_stats(source, start + a, {"x": np.asarray(x), "y": np.asarray(y)},
                               allow_nonfinite)
            stats = {k: merge_stats(stats[k], got[k]) for k in stats}
            dx[a:b] = x
            dy[a:b] = y
            if progress is not None:
                progress.update(b - a)
    return stats


def y_chunks(source, chunk) -> tuple | None:
    """A label volume's chunks: x's spatial chunks, so each rank reads its box of both the
    same way; per-sample targets are not chunked."""
    if tuple(source.y_shape) != tuple(source.x_shape[1:]):
        return None
    xc = x_chunks(source.x_shape, chunk)
    return (xc[0], *xc[2:])


def oserror_line(exc: OSError) -> str:
    """One line for an OSError: h5py's carry a multi-line HDF5 driver message, so the errno's
    own text is preferred ("No space left on device", "Read-only file system")."""
    if exc.errno:
        return os.strerror(exc.errno)
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _write_error(out: str, path: str, exc: Exception) -> Exception:
    """The one-line error of a failed shard or directory write (disk full, read-only...);
    other errors (a DataError about the values) pass unchanged."""
    if not isinstance(exc, OSError):
        return exc
    return DataError(f"{out}: cannot write {os.path.basename(path)} ({oserror_line(exc)}); "
                     f"nothing was published, the partial files are removed")


def dataset_bytes(source, counts: list[int], chunk=None) -> int:
    """An upper bound of the shard files' total size: x in whole chunks (edge chunks are
    stored full), y, and per shard 64 KiB plus 1% for HDF5's own metadata."""
    cshape = x_chunks(source.x_shape, chunk)[1:]
    padded = [-(-n // c) * c for n, c in zip(source.x_shape, cshape)]
    per_sample = (int(np.prod(padded)) * np.dtype(source.x_dtype).itemsize
                  + int(np.prod(source.y_shape)) * np.dtype(source.y_dtype).itemsize)
    raw = sum(counts) * per_sample
    return raw + raw // 100 + len(counts) * (64 << 10)


#: a dataset larger than this is announced (its size, on stderr) before it is written
ANNOUNCE_BYTES = 1 << 30


def reserve_space(out: str, tmp: str, need: int, what: str = "the dataset") -> None:
    """Allocate ``need`` bytes in ``tmp`` and free them again, before any HDF5 write: HDF5 cannot
    recover from a failed write (a full disk or quota makes the later close fail and the process
    crash), so the space is claimed first, the way the disk and quota count it. ``tmp`` is a
    writable directory on the same file system; DataError naming ``out`` (and ``what``) when there
    is not that much space."""
    reserve = os.path.join(tmp, f".space-check-{os.getpid()}")
    try:
        fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(need, 1))
        finally:
            os.close(fd)
            os.unlink(reserve)
    except OSError as exc:
        raise DataError(f"{out}: not enough space for {what} (about "
                        f"{need / 2**20:.1f} MiB needed: {oserror_line(exc)}); nothing was "
                        f"written") from None


def _check_replaceable(out: str) -> None:
    """``--force`` replaces only what hpcpar made: an empty directory, or a dataset directory
    (its ``manifest.json`` says so) holding nothing but the manifest and its shards, in its
    sub-folders too; never the working directory, one of its parents, or the home directory."""
    real = os.path.realpath(out)
    for what, d in (("the working directory", os.getcwd()), ("the home directory",
                                                             os.path.expanduser("~"))):
        if os.path.commonpath([real, os.path.realpath(d)]) == real:
            raise DataError(f"{out}: is {what} or contains it; --force replaces only a "
                            f"dataset directory hpcpar made (choose a new OUT)")
    if not os.path.isdir(out) or os.path.islink(out):
        raise DataError(f"{out}: exists and is not a directory; --force replaces only a "
                        f"dataset directory hpcpar made")
    entries = set(os.listdir(out))
    if not entries:
        return
    try:
        manifest = read_manifest(out)
    except DataError as exc:
        raise DataError(f"{out}: not an hpcpar dataset ({exc}); --force replaces only a "
                        f"dataset directory hpcpar made: remove it yourself or choose another "
                        f"OUT") from None
    files = {MANIFEST} | {os.path.normpath(s.file) for s in manifest.shards}
    dirs = {d for f in files for d in _parents(f)}
    foreign = sorted(_foreign_entries(out, files, dirs))
    if foreign:
        raise DataError(f"{out}: holds {foreign[0]!r}"
                        + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")
                        + " besides the dataset's own files; --force would delete it: move it "
                          "out first, or choose another OUT")


def _parents(path: str) -> list[str]:
    """``"a/b/c.h5"`` -> ``["a/b", "a"]``: the folders a relative path lies in."""
    parts = path.split(os.sep)[:-1]
    return [os.sep.join(parts[:i]) for i in range(len(parts), 0, -1)]


def _foreign_entries(out: str, files: set, dirs: set) -> list[str]:
    """Every path under ``out`` (sub-folders too) that is neither one of ``files`` nor a
    folder of ``dirs`` (relative paths): what ``--force`` would delete that hpcpar did not
    write. (Links are not followed, here nor by the removal.)"""
    foreign = []
    for root, subdirs, names in os.walk(out):
        rel = os.path.relpath(root, out)
        for name in names + subdirs:
            path = os.path.normpath(os.path.join(rel, name))
            if path not in (dirs if name in subdirs else files):
                foreign.append(path)
        subdirs[:] = [d for d in subdirs if os.path.normpath(os.path.join(rel, d)) in dirs]
    return foreign


def _make_temp_dir(out: str, force: bool) -> str:
    out = os.path.abspath(out)
    if os.path.lexists(out):
        if not force:
            raise DataError(f"{out}: already exists (use --force to replace it)")
        _check_replaceable(out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise DataError(f"{parent}: output's parent directory not found")
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    except OSError as exc:
        raise DataError(f"{out}: cannot create the dataset in {parent} "
                        f"({oserror_line(exc)})") from None
    umask = os.umask(0o22)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the dataset is not
    return tmp


def _publish(tmp: str, out: str) -> None:
    """Rename ``tmp`` to ``out``, replacing an existing ``out`` only after tmp is complete."""
    out = os.path.abspath(out)
    old = None
    if os.path.lexists(out):
        _check_replaceable(out)  # again: something may have moved in while the shards were written
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rename(out, os.path.join(old, "d"))
    os.rename(tmp, out)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def write_dataset(out: str, source: CosmoflowSource | H5Source | VolumeFiles,
                  counts: list[int], *,
                  comm: MPI.Comm | SerialComm | None = None,
                  chunk: int | tuple[int, int, int] | PerRankChunks | None = None,
                  force: bool = False,
                  progress: bool = True, allow_nonfinite: bool = False,
                  transform: str | None = None) -> Manifest:
    """Write a source's samples as a sharded dataset (collective).

    Each rank writes shards ``part_range(len(counts), ranks, rank)`` into a hidden
    ``.OUT.partial-*`` directory, renamed to ``out`` only when every rank has succeeded, so
    ``out`` is complete or absent. Rank 0 shows a progress bar of its own shards (on a
    terminal, or where ``HPCPAR_PROGRESS=1``). The manifest records min/max and the NaN/inf
    count of x and y per shard and overall. Returns the manifest on every rank.

    ``counts``: samples per shard (see [shard_counts][hpcpar.data.writer.shard_counts]);
    ``comm`` None: ``MPI.COMM_WORLD``. ``chunk``: chunk edge target of x: None (auto: a D edge of
    at most 32, half of H, all of W), one edge for D, H, W, a (D, H, W) triple (0: the whole axis)
    or ``PerRankChunks`` (one chunk per rank block; the manifest's ``source`` records that grid as
    ``chunk_grid``). ``force`` replaces an existing ``out`` (only after the new one is complete).
    ``allow_nonfinite`` accepts NaN/inf in the source (an error naming the sample otherwise).
    ``transform``: the input transform readers apply at run time, recorded in the manifest
    (``"none"`` or ``"log1p"``; the stored values are not changed); None: the source's own
    (``log1p`` for the CosmoFlow generator, else ``none``).

    DataError: ``out`` exists without ``force``, a write failed on some rank (named), non-finite
    values, or an unknown ``transform``."""
    transform = getattr(source, "transform", "none") if transform is None else transform
    if transform not in TRANSFORMS:
        raise DataError(f"transform {transform!r}: expected one of {', '.join(TRANSFORMS)}")
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    tmp = agree(comm, _start, out, force, source, counts, chunk, root=0)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    total = starts[-1]
    lo, hi = part_range(len(counts), size, rank)
    entries: list = []

    def write_mine() -> None:
        bar, path = None, tmp
        try:
            if progress and rank == 0:
                from tqdm import tqdm

                bar = tqdm(total=sum(counts[lo:hi]), unit="sample", dynamic_ncols=True,
                           # no bar lines in logs and pipes, unless HPCPAR_PROGRESS=1 asks
                           disable=not (sys.stderr.isatty() or _env.get("HPCPAR_PROGRESS")),
                           desc=f"writing {os.path.basename(os.path.abspath(out))}"
                                + (f" (rank 0 of {size})" if size > 1 else ""))
            for i in range(lo, hi):
                path = os.path.join(tmp, shard_name(i))
                st = _write_shard(path, source, i, starts[i], counts[i], total, len(counts),
                                  chunk, bar, allow_nonfinite)
                entries.append((Shard(shard_name(i), starts[i], counts[i],
                                      os.path.getsize(path), sha256_file(path)), st))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of the failure
            raise _write_error(out, path, exc) from None
        finally:
            if bar is not None:
                bar.close()

    try:
        agree(comm, write_mine, what=f"writing {out}", catch=Exception, foreign_as=DataError)
    except Exception:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    gathered = comm.gather(entries, root=0)
    return agree(comm, _finish, out, tmp, gathered, total, source, chunk, transform, root=0)


def _start(out: str, force: bool, source, counts: list[int], chunk) -> str:
    """Rank 0's first step of :func:`write_dataset`: the temporary directory, its space
    reserved (removed again when that fails)."""
    tmp = None
    try:
        tmp = _make_temp_dir(out, force)
        need = dataset_bytes(source, counts, chunk)
        reserve_space(out, tmp, need)
        if need > ANNOUNCE_BYTES:   # say it before the disk fills, not after
            print(f"hpcpar: writing {out}: {sum(counts)} samples, about "
                  f"{need / 1e9:.1f} GB", file=sys.stderr, flush=True)
    except DataError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _finish(out: str, tmp: str, gathered: list, total: int, source, chunk,
            transform: str) -> Manifest:
    """Rank 0's last step of :func:`write_dataset`: the manifest of every rank's shards
    (``gathered``), written, and the dataset published (the temporary directory removed when
    that fails)."""
    pairs = sorted((e for part in gathered for e in part), key=lambda e: e[0].start)
    shards = [s for s, _ in pairs]
    facts = dict(source.attrs)
    if isinstance(chunk, PerRankChunks):
        facts["chunk_grid"] = "x".join(str(p) for p in chunk.parts)
    manifest = Manifest(total,
                        Array("x", tuple(source.x_shape), str(np.dtype(source.x_dtype)),
                              x_chunks(source.x_shape, chunk)),
                        Array("y", tuple(source.y_shape), str(np.dtype(source.y_dtype)),
                              y_chunks(source, chunk), names=source.target_names),
                        shards, facts,
                        stats=dataset_stats({s.file: st for s, st in pairs}),
                        transform=transform)
    try:
        manifest.write(tmp)
        _publish(tmp, out)
    except (OSError, DataError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{out}: cannot publish the dataset ({oserror_line(exc)})") from None
    return manifest


class H5Source:
    """An existing single HDF5 file: the way real data comes in (``hpcpar data shard``).

    ``x_key`` names the inputs, ``(N, C, D, H, W)`` or ``(N, D, H, W)`` (C = 1 added); ``y_key`` the
    targets, ``(N, K)`` or ``(N,)``. DataError for a missing or unreadable file, or datasets of the
    wrong shapes."""

    def __init__(self, path: str, x_key: str = "x", y_key: str = "y"):
        check_file(path)
        self.path, self.x_key, self.y_key = path, x_key, y_key
        self.name, self.keys = path, {"x": x_key, "y": y_key}  # for messages
        self._f = open_h5(path)
        try:
            self._describe(path, x_key, y_key)
        except DataError:
            self._f.close()
            raise

    def _describe(self, path: str, x_key: str, y_key: str) -> None:
        for key in (x_key, y_key):
            if key not in self._f:
                raise DataError(f"{path}: missing dataset '{key}'")
        x, y = self._f[x_key], self._f[y_key]
        if x.ndim not in (4, 5):
            raise DataError(f"{path}: dataset '{x_key}' has shape {x.shape}, expected "
                            "(N, C, D, H, W) or (N, D, H, W)")
        if y.ndim not in (1, 2):
            raise DataError(f"{path}: dataset '{y_key}' has shape {y.shape}, expected "
                            "(N, K) or (N,)")
        if x.shape[0] != y.shape[0]:
            raise DataError(f"{path}: dataset '{x_key}' has {x.shape[0]} samples but "
                            f"'{y_key}' has {y.shape[0]}")
        self.samples = x.shape[0]
        self._x_channel = x.ndim == 4
        self.x_shape = (1, *x.shape[1:]) if self._x_channel else tuple(x.shape[1:])
        self.y_shape = (1,) if y.ndim == 1 else tuple(y.shape[1:])
        self.x_dtype, self.y_dtype = x.dtype, y.dtype
        names = y.attrs.get("names")
        self.target_names = [str(n) for n in names] if names is not None else None
        self.attrs = {"resharded_from": os.path.abspath(path), "x_key": x_key, "y_key": y_key}

    def __len__(self) -> int:
        return self.samples

    def read(self, start: int, stop: int):
        x = self._f[self.x_key][start:stop]
        y = self._f[self.y_key][start:stop]
        return (x[:, None] if self._x_channel else x), y.reshape(stop - start, *self.y_shape)

    def close(self) -> None:
        self._f.close()
