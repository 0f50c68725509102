"""Reading one rank's hyperslab of a list of samples straight into a caller's buffer.

Used in the main process (``prefetch=0``, ``mpio``) and in the prefetch process, so it needs
numpy + h5py only. Bytes read are counted as storage delivers them: every chunk the box
touches, whole (edge chunks are stored full size), plus the ``y`` rows.

Fast path (unfiltered chunked ``x``, POSIX files): HDF5's chunk index, walked once per shard,
gives each chunk's file offset. Chunks aligned with the rank's box and spanning its H and W
are read with one ``preadv`` straight into the output; otherwise each row of touched chunks is
read with one ``preadv`` per run of chunks adjacent in the file into a reused buffer, then
placed into the output with one transposing copy while the kernel's readahead fetches the
next rows. This avoids HDF5's per-chunk cache allocation and row-wise copies, which make
warm reads several times slower than a plain read. Anything else (compressed chunks,
contiguous datasets, the mpio driver) goes through ``read_direct`` with a chunk cache big
enough to hold a chunk, so HDF5 fetches each chunk once instead of row by row.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from hpcpar.data.format import open_h5
from hpcpar.errors import DataError

MAX_OPEN = 64  # shard files kept open at once
MAX_IOVECS = 64  # channels beyond this: chunks go through the staging buffer
IOV_PER_READ = 512  # buffers per preadv, well below IOV_MAX (1024 on Linux)


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
    descriptor for direct chunk reads (or None), the chunk plans of the boxes read and the
    file offset of every chunk (read once: a lookup per chunk per read costs as much as
    copying the chunk from the page cache)."""

    file: object
    x: object
    y: np.ndarray
    fd: int | None
    chunks: tuple | None
    dtype: np.dtype = None  # h5py's properties cost ~30 us a call: read once
    fill: object = 0
    plans: dict = field(default_factory=dict)
    _offsets: np.ndarray | None = None
    _row_offsets: dict = field(default_factory=dict)

    def plan(self, box) -> list:
        if box not in self.plans:
            self.plans[box] = chunk_plan(box, self.chunks)
        return self.plans[box]

    def chunk_offsets(self, row: int, box) -> list:
        """File offsets of the chunks ``box`` touches in sample ``row``, in the plan's order
        (None: never written)."""
        key = (row, box)
        if key not in self._row_offsets:  # every epoch reads the same (row, box) again
            if self._offsets is None:
                self._offsets = chunk_offset_table(self.x)
            coords = self.plan(box).coords
            self._row_offsets[key] = [None if off < 0 else off
                                      for off in self._offsets[row][coords].tolist()]
        return self._row_offsets[key]

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
        self.scratch: dict = {}  # staging buffers, reused across reads

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
        entry = OpenShard(f, dx, y, self._raw_fd(path, dx), dx.chunks, dx.dtype, dx.fillvalue)
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


@dataclass(frozen=True)
class ChunkPlan:
    """How to read one box: the touched chunks' grid (nd, nh, nw), the box inside the
    chunk-aligned super-box (None: aligned), whether chunks can be read straight into place
    (aligned, spanning the block's H and W), and the touched chunks' (kd, kh, kw) indices in
    row-major order, as 3 index arrays."""

    grid: tuple
    crop: tuple | None
    direct: bool
    coords: tuple


def chunk_offset_table(dx) -> np.ndarray:
    """(n, nd, nh, nw) int64 file offsets of all chunks of ``x`` (-1: not allocated), from one
    walk of HDF5's chunk index."""
    grid = [-(-n // c) for n, c in zip(dx.shape, dx.chunks)]
    table = np.full((grid[0], *grid[2:]), -1, np.int64)
    sizes = dx.chunks

    def visit(info):
        k = tuple(o // c for o, c in zip(info.chunk_offset, sizes))
        table[(k[0], *k[2:])] = info.byte_offset

    if hasattr(dx.id, "chunk_iter"):
        dx.id.chunk_iter(visit)
    else:  # pragma: no cover - HDF5 < 1.12.3 has no H5Dchunk_iter
        for i in range(dx.id.get_num_chunks()):
            visit(dx.id.get_chunk_info(i))
    return table


def chunk_plan(box, chunks) -> ChunkPlan:
    sizes = chunks[2:]
    ranges = [(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, sizes)]
    grid = tuple(k1 - k0 for k0, k1 in ranges)
    coords = tuple(k.ravel() for k in np.meshgrid(*(np.arange(k0, k1) for k0, k1 in ranges),
                                                  indexing="ij"))
    crop = tuple(slice(a - k0 * c, b - k0 * c) for (a, b), (k0, _), c in zip(box, ranges, sizes))
    aligned = all(s.start == 0 and s.stop == g * c for s, g, c in zip(crop, grid, sizes))
    direct = aligned and grid[1] == grid[2] == 1 and chunks[1] <= MAX_IOVECS
    return ChunkPlan(grid, None if aligned else crop, direct, coords)


def _pread(fd: int, buffers, offset: int, expected: int) -> None:
    got = os.preadv(fd, buffers, offset)
    if got != expected:
        raise OSError(f"short read at byte {offset}: {got} of {expected}")


def _scratch(scratch: dict, shape, dtype) -> np.ndarray:
    key = (tuple(shape), dtype)
    if key not in scratch:
        scratch[key] = np.empty(shape, dtype)
    return scratch[key]


def _read_run(sh: OpenShard, offsets, i: int, j: int, parts, nbytes: int) -> int:
    """Read chunks i..j-1, chunk q into the byte buffers ``parts(q)`` (filled in order), one
    ``preadv`` per stretch of chunks adjacent in the file; returns the bytes read."""
    nread = 0
    while i < j:
        if offsets[i] is None:  # never written: HDF5's fill value
            for part in parts(i):
                np.frombuffer(part, sh.dtype)[...] = sh.fill
            i += 1
            continue
        iov, m = [], i
        while m < j and len(iov) < IOV_PER_READ and offsets[m] == offsets[i] + (m - i) * nbytes:
            iov += parts(m)
            m += 1
        _pread(sh.fd, iov, offsets[i], (m - i) * nbytes)
        nread += (m - i) * nbytes
        i = m
    return nread


def _read_chunks(sh: OpenShard, row: int, box, dest: np.ndarray, scratch: dict) -> int:
    """Read the chunks of ``box`` of sample ``row`` into ``dest`` (C, d, h, w) with preadv:
    straight into place when the plan allows, else row of chunks by row of chunks into a
    reused buffer, each row then placed into ``dest`` by one transposing copy. Returns the
    bytes read from the file."""
    plan = sh.plan(box)
    c, cd, ch, cw = sh.chunks[1:]
    nbytes = c * cd * ch * cw * sh.dtype.itemsize
    offsets = sh.chunk_offsets(row, box)
    if plan.direct:  # chunk k is dest[:, k*cd:(k+1)*cd], one contiguous block per channel
        raw, (sc, sd) = memoryview(dest).cast("B"), dest.strides[:2]
        return _read_run(sh, offsets, 0, len(offsets), lambda k: [
            raw[i * sc + k * cd * sd:i * sc + (k + 1) * cd * sd] for i in range(c)], nbytes)
    nd, nh, nw = plan.grid
    staging = _scratch(scratch, (len(offsets), c, cd, ch, cw), sh.dtype)
    aligned = plan.crop is None and dest.flags.c_contiguous
    target = dest if aligned else _scratch(scratch, (c, nd * cd, nh * ch, nw * cw), sh.dtype)
    rows = target.reshape(c, nd, cd, nh, ch, nw, cw)
    nread = 0
    for r in range(nd * nh):  # read a row of chunks, place it while the kernel reads ahead
        i, j = r * nw, (r + 1) * nw
        nread += _read_run(sh, offsets, i, j, lambda q: [memoryview(staging[q]).cast("B")],
                           nbytes)
        rows[:, r // nh, :, r % nh] = staging[i:j].transpose(1, 2, 3, 0, 4)
    if not aligned:
        dest[...] = target[(slice(None), *(plan.crop or ()))]
    return nread


def read_samples(files: ShardFiles, items, box, out_x: np.ndarray, out_y: np.ndarray) -> int:
    """Read ``items`` [(shard, row), ...] into out_x[j] (C, d, h, w) and out_y[j]; returns
    bytes fetched from storage (whole chunks touched, plus ``y`` of newly opened shards)."""
    box = tuple(tuple(int(v) for v in b) for b in box)
    sel = tuple(slice(a, b) for a, b in box)
    total = 0
    for j, (shard, row) in enumerate(items):
        sh = files.get(shard)
        row = int(row)
        try:
            if sh.fd is not None:
                total += _read_chunks(sh, row, box, out_x[j], files.scratch)
            else:
                sh.x.read_direct(out_x, (row, slice(None), *sel), np.s_[j])
                # whole chunks through HDF5's chunk cache; a contiguous layout: the selection
                total += touched_chunk_bytes(box, sh.chunks, sh.dtype.itemsize) \
                    if sh.chunks else out_x[j].nbytes
        except (OSError, ValueError, TypeError) as exc:
            raise DataError(f"{files.paths[shard]}: reading sample row {row} failed "
                            f"({str(exc).splitlines()[0]})") from None
        out_y[j] = sh.y[row]
    total += files.pending_bytes
    files.pending_bytes = 0
    return total
