"""Reading one rank's hyperslab of a list of samples straight into a caller's buffer.

Used in the main process (``prefetch=0``, ``mpio``) and in the prefetch process, so it needs
numpy + h5py only. Bytes read are counted as storage delivers them: every chunk the box
touches, whole (edge chunks are stored full size), plus the ``y`` rows.

Fast path (unfiltered chunked ``x``, POSIX files): HDF5's chunk index gives each chunk's file
offset and the chunk is read with one ``preadv`` — straight into the output when the chunk
lands in a few contiguous runs of it (chunks aligned with the rank's box), else into a reused
buffer and copied. This avoids HDF5's per-chunk cache allocation and copy, which otherwise
makes warm reads several times slower than a plain read. Anything else (compressed chunks,
contiguous datasets, the mpio driver) goes through ``read_direct`` with a chunk cache big
enough to hold a chunk, so HDF5 fetches each chunk once instead of row by row.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .errors import DataError
from .format import open_h5

MAX_OPEN = 64  # shard files kept open at once
MAX_IOVECS = 64  # a chunk landing in more runs of the output than this goes via a buffer


def touched_chunk_bytes(box, chunks, itemsize: int) -> int:
    """Bytes of the ``x`` chunks of one sample that box ((d0,d1),(h0,h1),(w0,w1)) touches."""
    n = 1
    for (a, b), c in zip(box, chunks[2:]):
        n *= (b - 1) // c - a // c + 1 if b > a else 0
    return n * int(np.prod(chunks[1:])) * itemsize


def cache_bytes(chunks, itemsize: int) -> int:
    return max(1 << 20, 2 * int(np.prod(chunks)) * itemsize)


@dataclass
class OpenShard:
    """One open shard: the ``x`` dataset, all of ``y`` (small: loaded at open), a plain
    descriptor for direct chunk reads (or None) and the chunk plans of the boxes read."""

    file: object
    x: object
    y: np.ndarray
    fd: int | None
    chunks: tuple | None
    plans: dict = field(default_factory=dict)

    def plan(self, box) -> list:
        if box not in self.plans:
            self.plans[box] = chunk_plan(box, self.chunks)
        return self.plans[box]

    def close(self) -> None:
        self.file.close()
        if self.fd is not None:
            os.close(self.fd)


class ShardFiles:
    """Lazily opened shard files (at most ``MAX_OPEN``). ``pending_bytes``: bytes read while
    opening (the ``y`` arrays) not yet reported by :func:`read_samples`."""

    def __init__(self, paths, x_key: str = "x", y_key: str = "y", opener=None, **open_kwargs):
        self.paths, self.x_key, self.y_key = list(paths), x_key, y_key
        self.open_kwargs = open_kwargs
        self.opener = opener or open_h5
        self._open: OrderedDict = OrderedDict()
        self.pending_bytes = 0

    def get(self, shard: int) -> OpenShard:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        if len(self._open) >= MAX_OPEN:
            self._open.popitem(last=False)[1].close()
        path = self.paths[shard]
        f = self.opener(path, **self.open_kwargs)
        for key in (self.x_key, self.y_key):
            if key not in f:
                f.close()
                raise DataError(f"{path}: missing dataset '{key}'")
        dx = f[self.x_key]
        y = f[self.y_key][()]
        self.pending_bytes += y.nbytes
        entry = OpenShard(f, dx, y, self._raw_fd(path, dx), dx.chunks)
        self._open[shard] = entry
        return entry

    def _raw_fd(self, path: str, dx):
        """A plain read-only descriptor when chunks can be read without HDF5's help."""
        if self.open_kwargs.get("driver") not in (None, "sec2") or self.opener is not open_h5:
            return None
        if not dx.chunks or dx.id.get_create_plist().get_nfilters():
            return None
        return os.open(path, os.O_RDONLY)

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()


def chunk_plan(box, chunks) -> list:
    """For each chunk the box touches: (chunk origin (D, H, W), slices inside the chunk,
    slices inside the rank's block)."""
    per_axis = []
    for (a, b), c in zip(box, chunks[2:]):
        axis = []
        for k in range(a // c, (b - 1) // c + 1):
            lo, hi = max(a, k * c), min(b, (k + 1) * c)
            axis.append((k * c, slice(lo - k * c, hi - k * c), slice(lo - a, hi - a)))
        per_axis.append(axis)
    return [(tuple(p[0] for p in combo), tuple(p[1] for p in combo),
             tuple(p[2] for p in combo)) for combo in itertools.product(*per_axis)]


def _runs(view: np.ndarray):
    """``view`` as a list of contiguous byte memoryviews, or None if that takes too many."""
    inner = view.ndim
    while inner > 0 and view[(0,) * (inner - 1)].flags.c_contiguous:
        inner -= 1
    outer = view.shape[:inner]
    if int(np.prod(outer)) > MAX_IOVECS:
        return None
    return [memoryview(view[idx]).cast("B") for idx in np.ndindex(*outer)] if outer else \
        [memoryview(view).cast("B")]


def _read_chunks(sh: OpenShard, row: int, box, dest: np.ndarray, scratch: dict) -> None:
    """Read the chunks of ``box`` of sample ``row`` into ``dest`` (C, d, h, w) with preadv."""
    dx, chunk_shape = sh.x, sh.chunks[1:]
    for origin, src, dst in sh.plan(box):
        info = dx.id.get_chunk_info_by_coord((row, 0, *origin))
        region = dest[(slice(None), *dst)]
        if info.byte_offset is None:  # never written: HDF5's fill value
            region[...] = dx.fillvalue
            continue
        whole = all(s.stop - s.start == n for s, n in zip(src, chunk_shape[1:]))
        runs = _runs(region) if whole else None
        if runs is not None:  # the chunk's bytes go straight to their place
            got = os.preadv(sh.fd, runs, info.byte_offset)
        else:
            buf = scratch.get(chunk_shape)
            if buf is None:
                buf = scratch[chunk_shape] = np.empty(chunk_shape, dx.dtype)
            got = os.preadv(sh.fd, [memoryview(buf).cast("B")], info.byte_offset)
            region[...] = buf[(slice(None), *src)]
        if got != info.size:
            raise OSError(f"short read at byte {info.byte_offset}: {got} of {info.size}")


def read_samples(files: ShardFiles, items, box, out_x: np.ndarray, out_y: np.ndarray) -> int:
    """Read ``items`` [(shard, row), ...] into out_x[j] (C, d, h, w) and out_y[j]; returns
    bytes fetched from storage (whole chunks touched, plus ``y`` of newly opened shards)."""
    box = tuple(tuple(int(v) for v in b) for b in box)
    sel = tuple(slice(a, b) for a, b in box)
    total = 0
    scratch: dict = {}
    for j, (shard, row) in enumerate(items):
        sh = files.get(shard)
        row = int(row)
        try:
            if sh.fd is not None:
                _read_chunks(sh, row, box, out_x[j], scratch)
            else:
                sh.x.read_direct(out_x, (row, slice(None), *sel), np.s_[j])
        except (OSError, ValueError, TypeError) as exc:
            raise DataError(f"{files.paths[shard]}: reading sample row {row} failed "
                            f"({str(exc).splitlines()[0]})") from None
        out_y[j] = sh.y[row]
        if sh.chunks:
            total += touched_chunk_bytes(box, sh.chunks, sh.x.dtype.itemsize)
        else:  # contiguous layout: HDF5 reads just the selection
            total += out_x[j].nbytes
    total += files.pending_bytes
    files.pending_bytes = 0
    return total
