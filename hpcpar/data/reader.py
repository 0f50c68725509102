"""``ShardedVolumeDataset``: each rank reads only its samples' sub-volumes from HDF5 shards.

Two ways to open files:

- default (any h5py): every rank opens the shard files it needs independently, read-only,
  with the POSIX driver, inside its prefetch process (``prefetch > 0``) or itself
  (``prefetch=0``).
- ``driver="mpio"`` (h5py built against MPI, ``h5py.get_config().mpi``): the files — typically
  one big shared file given as ``path`` — are opened collectively on ``grid.comm`` with the
  ``mpio`` driver and read independently in the main process (an MPI file handle cannot move
  to another process, so ``prefetch`` is ignored).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hpcpar.data._hyperslab import ShardFiles, cache_bytes, read_samples
from hpcpar.data._prefetch import Prefetcher, SlotLayout
from hpcpar.data._schedule import VolumeDatasetBase
from hpcpar.data.augment import view_code
from hpcpar.errors import DataError
from hpcpar.parallel.counters import COUNTERS
from hpcpar.parallel.grid import ProcessGrid

from .format import (
    Array,
    Manifest,
    Shard,
    check_file,
    check_finite,
    check_shard,
    open_h5,
    read_manifest,
)
from .staging import stage_shards

__all__ = ["ShardedVolumeDataset"]


def single_file_manifest(path: str, x_key: str = "x", y_key: str = "y") -> Manifest:
    """Describe a single HDF5 file holding ``x_key`` (N, C, D, H, W) and ``y_key`` (N, K) as a
    one-shard dataset, so it can be read like a sharded one. DataError for a missing or non-HDF5
    file, a missing dataset or other shapes."""
    check_file(path)
    with open_h5(path) as f:
        for key in (x_key, y_key):
            if key not in f:
                raise DataError(f"{path}: missing dataset '{key}'")
        x, y = f[x_key], f[y_key]
        if x.ndim != 5 or y.ndim != 2 or x.shape[0] != y.shape[0]:
            raise DataError(f"{path}: datasets '{x_key}' {x.shape} and '{y_key}' {y.shape} "
                            "must be (N, C, D, H, W) and (N, K)")
        n = x.shape[0]
        xa = Array(x_key, tuple(x.shape[1:]), str(x.dtype), x.chunks)
        ya = Array(y_key, tuple(y.shape[1:]), str(y.dtype))
    return Manifest(n, xa, ya, [Shard(os.path.basename(path), 0, n, os.path.getsize(path))])


class ShardedVolumeDataset(VolumeDatasetBase):
    """Per-rank hyperslab reader of a sharded volume dataset (format: ``docs/guides/data.md``).

    Each rank reads only its data group's samples and, of each, only its own sub-volume. Iterating
    yields ``(x_local, y)`` torch tensors: ``x_local`` ``(n, C, d, h, w)`` is this rank's sub-volume
    of its data group's ``n`` samples, ``y`` is ``(n, K)``, or ``(n, d, h, w)``, the same sub-volume
    of a label volume (``manifest.voxel_targets``). ``len()`` is the number of steps per epoch;
    ``set_epoch``, ``state_dict`` and ``load_state_dict`` make iteration resumable mid-epoch.

    Construction is collective over ``grid.comm`` (shard checks are split over ranks; staging
    synchronises each node). ``path``: a dataset directory or a single HDF5 file. In ``grid``, data
    groups split the batch, x/y/z split each volume. ``batch_size`` is the GLOBAL batch (samples per
    step over all data groups). ``shuffle`` is seeded by ``seed``: identical on every rank.
    ``prefetch``: batches read ahead by a separate reader process (0: read inline). ``stage_to``:
    copy the shards this node needs to this (node-local) directory first. ``driver``: None or
    ``"sec2"`` (POSIX), or ``"mpio"`` (collective MPI-IO, no prefetch). ``verify`` compares every
    shard's sha256 with the manifest before the first read (split over the ranks; sha256 runs at
    0.5-1 GB/s on one core), so a corrupted shard is a named error before training, not NaN. Values
    are always checked for NaN/inf the manifest does not allow, batch by batch (one sum).

    DataError, the same on every rank: a missing or corrupt shard, a manifest of another format
    version, a batch larger than the dataset or smaller than the number of data groups, a volume
    smaller than the grid, or an unknown ``driver``."""

    def __init__(self, path: str | os.PathLike, grid: ProcessGrid, batch_size: int, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 prefetch: int = 2, stage_to: str | os.PathLike | None = None,
                 driver: str | None = None, verify: bool = True, flip: bool = False,
                 rot90: bool = False):
        path = os.fspath(path)
        if os.path.isfile(path):
            self.directory = os.path.dirname(os.path.abspath(path))
            self.manifest = single_file_manifest(path)
        else:
            self.directory = path
            self.manifest = read_manifest(path)
        m = self.manifest
        super().__init__(grid, batch_size, m.num_samples, m.x.shape[1:], shuffle=shuffle,
                         seed=seed, drop_last=drop_last, name=path)
        if driver not in (None, "sec2", "mpio"):
            raise DataError(f"{path}: driver must be None, 'sec2' or 'mpio', got {driver!r}")
        self.driver = driver or "sec2"
        self.flip, self.rot90, self.seed = flip, rot90, seed
        if rot90 and m.x.shape[2] != m.x.shape[3]:
            raise DataError(f"{path}: rot90 turns the (H, W) plane, but the samples are "
                            f"{'x'.join(map(str, m.x.shape[1:]))} (H != W)")
        self.prefetch = 0 if self.driver == "mpio" else max(0, int(prefetch))
        self._check_shards(grid.comm, checksum=verify)
        self.bytes_read = 0
        self.bytes_staged = 0
        self.staged_dir = None
        paths = [os.path.join(self.directory, s.file) for s in m.shards]
        if stage_to is not None:
            staged, self.bytes_staged = stage_shards(self.directory, m, self._needed_shards(),
                                                     os.fspath(stage_to), grid.node_comm)
            paths = [os.path.join(staged, s.file) for s in m.shards]
            self.staged_dir = staged
        self.paths = paths
        self._open_kwargs = {}
        if m.x.chunks:
            self._open_kwargs = {"rdcc_nbytes": cache_bytes(m.x.chunks,
                                                            np.dtype(m.x.dtype).itemsize),
                                 "rdcc_w0": 1.0}
        self._files: ShardFiles | None = None
        self._prefetcher = None

    # -- setup ------------------------------------------------------------------------------
    def _check_shards(self, comm, checksum: bool = True) -> None:
        """Every shard against the manifest (and its sha256 when ``checksum``), split over the
        ranks; the same first error is raised on every rank."""
        rank, size = comm.Get_rank(), comm.Get_size()
        problems = []
        for i in range(rank, len(self.manifest.shards), size):
            try:
                if len(self.manifest.shards) == 1 and not self.manifest.shards[0].sha256:
                    continue  # a single file: checked when its manifest was made
                check_shard(self.directory, self.manifest, i, checksum=checksum)
            except DataError as exc:
                problems.append((i, str(exc)))
        everything = sorted(p for part in comm.allgather(problems) for p in part)
        if everything:
            raise DataError(everything[0][1])

    def _needed_shards(self) -> set:
        """Shards this rank may read: all when shuffled, else those of its fixed samples."""
        m = self.manifest
        if self.schedule.shuffle:
            return set(range(len(m.shards)))
        return {m.locate(int(i))[0] for step in self.schedule.local_steps(0) for i in step}

    def _items(self, samples, epoch: int = 0) -> list:
        """``(shard, row)`` of each sample, with its view (:mod:`hpcpar.data.augment`) when
        flips or rotations are on."""
        if not (self.flip or self.rot90):
            return [self.manifest.locate(int(i)) for i in samples]
        return [(*self.manifest.locate(int(i)),
                 view_code(self.seed, epoch, int(i), self.flip, self.rot90)) for i in samples]

    def _sample_shapes(self):
        m = self.manifest
        ys = self.local_shape if m.voxel_targets else m.y.shape
        return (m.x.shape[0], *self.local_shape), m.x.dtype, ys, m.y.dtype

    # -- reading ----------------------------------------------------------------------------
    def _open_files(self) -> ShardFiles:
        if self._files is None:
            kwargs: dict[str, Any] = dict(self._open_kwargs)
            if self.driver == "mpio":
                import h5py

                if not h5py.get_config().mpi:
                    raise DataError(f"{self.name}: driver='mpio' needs h5py built with MPI "
                                    "(h5py.get_config().mpi is False)")
                kwargs.update(driver="mpio", comm=self.grid.comm)
                files = ShardFiles(self.paths, self.manifest.x.key, self.manifest.y.key,
                                   **kwargs)
                for i in range(len(self.paths)):  # collective opens, same order everywhere
                    files.get(i)
                self._files = files
            else:
                self._files = ShardFiles(self.paths, self.manifest.x.key,
                                         self.manifest.y.key, **kwargs)
        return self._files

    def _count(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        COUNTERS.bytes_read += nbytes

    def _batches(self, epoch: int, start: int):
        steps = self.schedule.local_steps(epoch, start)
        if self.prefetch:
            yield from self._prefetched(steps, epoch)
            return
        import torch

        files = self._open_files()
        xs, xd, ys, yd = self._sample_shapes()
        for samples in steps:
            x = np.empty((len(samples), *xs), xd)
            y = np.empty((len(samples), *ys), yd)
            items = self._items(samples, epoch)
            self._count(read_samples(files, items, self.box, x, y, self.manifest.x.shape[1:]))
            check_finite(x, y, items, self.manifest, self.directory)
            yield torch.from_numpy(x), torch.from_numpy(y)

    def _start_prefetcher(self):
        if self._prefetcher is not None and self._prefetcher.alive:
            return self._prefetcher
        xs, xd, ys, yd = self._sample_shapes()
        layout = SlotLayout(self.prefetch, self.schedule.max_local, xs, xd, ys, yd)
        self._prefetcher = Prefetcher(self.paths, self.manifest.x.key, self.manifest.y.key,
                                      self.box, layout, self._open_kwargs,
                                      self.manifest.x.shape[1:])
        return self._prefetcher

    def _prefetched(self, steps, epoch: int):
        import torch

        pf = self._start_prefetcher()
        depth = pf.layout.depth
        try:
            for k in range(min(depth, len(steps))):
                pf.submit(k % depth, self._items(steps[k], epoch))
            for k in range(len(steps)):
                slot, n, nbytes = pf.result()
                x, y = pf.views(slot)
                xt, yt = torch.from_numpy(x[:n].copy()), torch.from_numpy(y[:n].copy())
                del x, y
                self._count(nbytes)
                check_finite(xt.numpy(), yt.numpy(), self._items(steps[k], epoch), self.manifest,
                             self.directory)
                if k + depth < len(steps):
                    pf.submit(slot, self._items(steps[k + depth], epoch))
                yield xt, yt
        finally:
            pf.drain()

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the prefetch process and close files (also done at garbage collection)."""
        if self._active is not None:
            self._active.close()
            self._active = None
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._files is not None:
            self._files.close()
            self._files = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
