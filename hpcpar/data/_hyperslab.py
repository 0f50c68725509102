"""Reading one rank's hyperslab of a list of samples straight into a caller's buffer.

Used in the main process (``prefetch=0``, ``mpio``) and in the prefetch process, so it needs
numpy + h5py only. Bytes read are counted as storage delivers them: every chunk the box
touches, whole (edge chunks are stored full size), plus the ``y`` rows.

Fast path (unfiltered chunked ``x``, POSIX files): HDF5's chunk index, walked once per shard, gives
each chunk's file offset. When the rank's box covers whole chunks along W (the default chunks span
the whole W axis), every chunk lands in the output as a few long contiguous pieces (one per channel
and D plane, or one per channel when the chunk also spans the box's H), so each run of chunks
adjacent in the file is read with one ``preadv`` straight into the output; the parts of a chunk
outside the box (a box not aligned with chunk edges along D or H) go to a reused discard buffer, so
whole chunks are still read in one sequential pass. The hundreds of buffer addresses per sample are
computed with numpy and passed to libc's ``preadv`` directly (building as many Python buffer objects
costs a third of the read). Otherwise (boxes that cut chunks along W) each row of touched chunks is
read with one ``preadv`` per run of chunks adjacent in the file into a reused buffer, then placed
into the output with one transposing copy while the kernel's readahead fetches the next rows: that
copy costs about as much as the read itself from the page cache. Both avoid HDF5's per-chunk cache
allocation and row-wise copies, which make warm reads several times slower than a plain read.
Anything else (compressed chunks, contiguous datasets, the mpio driver) goes through ``read_direct``
with a chunk cache big enough to hold a chunk, so HDF5 fetches each chunk once instead of row by
row."""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcpar.data.augment import apply_view, source_box
from hpcpar.data.format import open_h5
from hpcpar.errors import DataError

MAX_OPEN = 64  # shard files kept open at once
IOV_PER_READ = 512  # buffers per preadv, well below IOV_MAX (1024 on Linux)
MIN_PIECE = 1024  # bytes: smaller average pieces of a direct read go through the staging copy


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
    """One open shard: the ``x`` dataset, all of ``y`` (small: loaded at open; a label volume stays
    a dataset, read by hyperslab), a plain descriptor for direct chunk reads (or None), the chunk
    plans of the boxes read and the file offset of every chunk (read once: a lookup per chunk per
    read costs as much as copying the chunk from the page cache)."""

    file: Any  # h5py.File (h5py ships no types)
    x: Any  # its h5py.Dataset
    y: Any  # np.ndarray, or the h5py.Dataset of a label volume
    fd: int | None
    chunks: tuple | None
    dtype: np.dtype  # h5py's properties cost ~30 us a call: read once
    fill: object = 0
    plans: dict = field(default_factory=dict)
    _offsets: np.ndarray | None = None
    _row_offsets: dict = field(default_factory=dict)

    def plan(self, box) -> ChunkPlan:
        if box not in self.plans:
            self.plans[box] = chunk_plan(box, self.chunks, self.dtype.itemsize)
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

    def __init__(self, paths, x_key: str = "x", y_key: str | None = "y", opener=None,
                 **open_kwargs):
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
            if key is not None and key not in f:
                f.close()
                raise DataError(f"{path}: missing dataset '{key}'")
        dx = f[self.x_key]
        if self.y_key is None:  # inputs only (a volume to predict): an empty row per sample
            y = np.zeros((dx.shape[0], 0), np.float32)
        else:
            y = f[self.y_key]
        if y.ndim != 4:    # per-sample targets: small, loaded at open; a label volume
            y = y[()]      # (N, D, H, W) is read by hyperslab like x
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
    chunk-aligned super-box (None: aligned), the touched chunks' (kd, kh, kw) indices in
    row-major order, as 3 index arrays, and, when chunks can be read straight into place,
    ``pieces``: for each touched chunk, its bytes in file order as an (n, 2) int64 array of
    ``(nbytes, dest_offset)`` rows (``dest_offset`` -1: outside the box, read into the
    discard buffer), with ``discard`` the longest such gap (else 0)."""

    grid: tuple
    crop: tuple | None
    coords: tuple
    pieces: tuple | None = None
    discard: int = 0
    _runs: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def direct(self) -> bool:
        return self.pieces is not None

    def run(self, q: int, m: int) -> tuple:
        """Chunks q..m-1 (adjacent in the file) as one read: the pieces' sizes, their output
        offsets (-1: discard) and the running byte count, computed once per plan."""
        if (q, m) not in self._runs:
            assert self.pieces is not None, "run() of a plan that cannot read in place"
            table = np.concatenate(self.pieces[q:m])
            self._runs[(q, m)] = (table[:, 0].astype(np.uint64), table[:, 1],
                                  np.cumsum(table[:, 0]).tolist(), {})
        return self._runs[(q, m)]


def chunk_pieces(box, chunks, k, itemsize: int) -> list:
    """Chunk ``k`` = (kd, kh, kw)'s bytes in file order as merged ``(nbytes, dest_offset)``
    pairs, for a C-contiguous (C, d, h, w) output of ``box`` that holds the chunk's whole W
    extent (-1: bytes outside the box)."""
    c, cd, ch, cw = chunks[1:]
    (d0, d1), (h0, h1), (w0, w1) = box
    bd, bh, bw = d1 - d0, h1 - h0, w1 - w0
    od, oh, ow = k[0] * cd, k[1] * ch, k[2] * cw  # the chunk's origin in the volume
    da, db = max(d0 - od, 0), min(d1 - od, cd)
    ha, hb = max(h0 - oh, 0), min(h1 - oh, ch)
    row = cw * itemsize
    out: list = []

    def add(nbytes: int, dest: int) -> None:
        if nbytes <= 0:
            return
        if out and (out[-1][1] < 0) == (dest < 0) and (
                dest < 0 or out[-1][1] + out[-1][0] == dest):
            out[-1] = (out[-1][0] + nbytes, out[-1][1])
        else:
            out.append((nbytes, dest))

    for ci in range(c):
        for d in range(cd):
            if not da <= d < db:
                add(ch * row, -1)
                continue
            add(ha * row, -1)
            base = ((ci * bd + od + d - d0) * bh + oh - h0) * bw + ow - w0
            if cw == bw:  # the chunk spans the box's W: its rows are one piece
                add((hb - ha) * row, (base + ha * bw) * itemsize)
            else:
                for h in range(ha, hb):
                    add(row, (base + h * bw) * itemsize)
            add((ch - hb) * row, -1)
    return out


@functools.lru_cache(maxsize=64)
def chunk_plan(box, chunks, itemsize: int = 4) -> ChunkPlan:
    """The plan of reading ``box`` (a tuple of (start, stop) pairs) of a sample chunked
    ``chunks`` (shared by every shard with those chunks)."""
    sizes = chunks[2:]
    ranges = [(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, sizes)]
    grid = tuple(k1 - k0 for k0, k1 in ranges)
    coords = tuple(k.ravel() for k in np.meshgrid(*(np.arange(k0, k1) for k0, k1 in ranges),
                                                  indexing="ij"))
    crop = tuple(slice(a - k0 * c, b - k0 * c) for (a, b), (k0, _), c in zip(box, ranges, sizes))
    aligned = all(s.start == 0 and s.stop == g * c for s, g, c in zip(crop, grid, sizes))
    pieces, discard = None, 0
    whole_w = crop[2].start == 0 and crop[2].stop == grid[2] * sizes[2]
    if whole_w and (grid[2] == 1 or sizes[2] * itemsize >= MIN_PIECE):
        pieces = tuple(np.array(chunk_pieces(box, chunks, k, itemsize), np.int64).reshape(-1, 2)
                       for k in zip(*coords))
        table = np.concatenate(pieces)
        wanted = table[table[:, 1] >= 0, 0]
        discard = int(table[table[:, 1] < 0, 0].max(initial=0))
        if wanted.sum() < MIN_PIECE * len(wanted):  # tiny pieces: one staging copy is faster
            pieces, discard = None, 0
    return ChunkPlan(grid, None if aligned else crop, coords, pieces, discard)


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
    fd = sh.fd
    assert fd is not None, "chunks are read with preadv only through a raw descriptor"
    nread = 0
    while i < j:
        if offsets[i] is None:  # never written: HDF5's fill value
            for part in parts(i):
                np.frombuffer(part, sh.dtype)[...] = sh.fill
            i += 1
            continue
        iov: list = []
        m = i
        while m < j and len(iov) < IOV_PER_READ and offsets[m] == offsets[i] + (m - i) * nbytes:
            iov += parts(m)
            m += 1
        _pread(fd, iov, offsets[i], (m - i) * nbytes)
        nread += (m - i) * nbytes
        i = m
    return nread


@functools.cache
def _libc_preadv():
    """libc's ``preadv`` taking an iovec array's address (None where it cannot be loaded)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).preadv
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    fn.restype = ctypes.c_ssize_t
    return fn


def _iovecs(run: tuple, base: int, spare: int) -> np.ndarray:
    """The run's ``struct iovec`` array for an output at address ``base`` and a discard buffer
    at ``spare``, kept for the last few outputs (the prefetch slots and a caller's reused
    buffer come back every step); a new array each time, never one changed in place."""
    sizes, at, _, kept = run
    key = (base, spare)
    iov = kept.get(key)
    if iov is None:
        iov = np.empty((len(sizes), 2), np.uint64)  # {void *iov_base; size_t iov_len}
        iov[:, 0] = np.where(at >= 0, base + at, spare)
        iov[:, 1] = sizes
        if len(kept) >= 64:
            kept.pop(next(iter(kept)))
        kept[key] = iov
    return iov


def _preadv_table(fd: int, run: tuple, base: int, spare: int, offset: int) -> None:
    """Read a run's bytes from ``offset`` on into its pieces (``ChunkPlan.run``) of the buffer
    at address ``base`` (discarded parts into the buffer at ``spare``), IOV_PER_READ pieces
    per call."""
    iov, ends = _iovecs(run, base, spare), run[2]
    preadv = _libc_preadv()
    address = iov.ctypes.data
    for i in range(0, len(iov), IOV_PER_READ):
        j = min(i + IOV_PER_READ, len(iov))
        want = ends[j - 1] - (ends[i - 1] if i else 0)
        got = preadv(fd, address + i * 16, j - i, offset)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got != want:
            raise OSError(f"short read at byte {offset}: {got} of {want}")
        offset += want


def _preadv_buffers(fd: int, run: tuple, raw: memoryview, trash: np.ndarray,
                    offset: int) -> None:
    """The same with Python buffer objects (where libc's preadv cannot be loaded)."""
    spare = trash.data.cast("B")
    iov = [raw[at:at + size] if at >= 0 else spare[:size]
           for size, at in zip(run[0].tolist(), run[1].tolist())]
    for i in range(0, len(iov), IOV_PER_READ):
        part = iov[i:i + IOV_PER_READ]
        want = sum(len(b) for b in part)
        _pread(fd, part, offset, want)
        offset += want


def _read_direct(sh: OpenShard, plan: ChunkPlan, offsets, dest: np.ndarray,
                 scratch: dict, nbytes: int) -> int:
    """Read the touched chunks straight into ``dest`` (C-contiguous) and the discard buffer,
    one pass per run of chunks adjacent in the file; returns the bytes read."""
    fd, pieces = sh.fd, plan.pieces
    assert fd is not None and pieces is not None, "a direct read needs a descriptor and pieces"
    trash = _scratch(scratch, (max(plan.discard, 1),), np.uint8)
    fast = _libc_preadv() is not None
    base = dest.ctypes.data if fast else 0  # libc's preadv writes at this address
    nread, q, n = 0, 0, len(offsets)
    while q < n:
        if offsets[q] is None:  # never written: HDF5's fill value
            raw = dest.data.cast("B")
            for size, at in pieces[q].tolist():
                if at >= 0:
                    np.frombuffer(raw[at:at + size], sh.dtype)[...] = sh.fill
            q += 1
            continue
        m = q + 1
        while m < n and offsets[m] is not None and offsets[m] == offsets[q] + (m - q) * nbytes:
            m += 1
        if fast:
            _preadv_table(fd, plan.run(q, m), base, trash.ctypes.data, offsets[q])
        else:
            _preadv_buffers(fd, plan.run(q, m), dest.data.cast("B"), trash, offsets[q])
        nread += (m - q) * nbytes
        q = m
    return nread


def _read_chunks(sh: OpenShard, row: int, box, dest: np.ndarray, scratch: dict) -> int:
    """Read the chunks of ``box`` of sample ``row`` into ``dest`` (C, d, h, w) with preadv:
    straight into place when the plan allows, else row of chunks by row of chunks into a
    reused buffer of one row, each chunk's part inside the box then copied into ``dest``.
    The buffer is one row of chunks, not the touched region: a rank's reader holds about
    its hyperslab, not twice the whole chunks around it (at 240^3 x 4 on 2x2x2 with 32^3
    chunks, 4 MiB instead of 96 MiB per rank). Returns the bytes read from the file."""
    plan = sh.plan(box)
    assert sh.chunks is not None, "a raw descriptor is only opened for a chunked layout"
    c, *sizes = sh.chunks[1:]
    nbytes = c * math.prod(sizes) * sh.dtype.itemsize
    offsets = sh.chunk_offsets(row, box)
    if plan.direct and dest.flags.c_contiguous:
        return _read_direct(sh, plan, offsets, dest, scratch, nbytes)
    nd, nh, nw = plan.grid
    crop = plan.crop or tuple(slice(0, g * n) for g, n in zip(plan.grid, sizes))
    staging = _scratch(scratch, (nw, c, *sizes), sh.dtype)
    nread = 0
    for r in range(nd * nh):  # read a row of chunks, place it while the kernel reads ahead
        i = r * nw
        nread += _read_run(sh, offsets, i, i + nw,
                           lambda q, i=i: [staging[q - i].data.cast("B")], nbytes)
        for kw in range(nw):
            _place(dest, staging[kw], crop, (r // nh, r % nh, kw), sizes)
    return nread


def _place(dest: np.ndarray, chunk: np.ndarray, crop, k, sizes) -> None:
    """Copy the part of ``chunk`` (C, cd, ch, cw), at index ``k`` of the touched chunks' grid,
    that lies inside the box (``crop`` of the chunk-aligned region) into ``dest``."""
    src, dst = [slice(None)], [slice(None)]
    for kk, n, cut in zip(k, sizes, crop):
        lo, hi = max(cut.start, kk * n), min(cut.stop, (kk + 1) * n)
        src.append(slice(lo - kk * n, hi - kk * n))
        dst.append(slice(lo - cut.start, hi - cut.start))
    dest[tuple(dst)] = chunk[tuple(src)]


def _read_box(files: ShardFiles, sh: OpenShard, row: int, box, dest: np.ndarray) -> int:
    """Read ``box`` of sample ``row``'s x into ``dest`` (C, d, h, w); returns bytes fetched."""
    if sh.fd is not None:
        return _read_chunks(sh, row, box, dest, files.scratch)
    sel = tuple(slice(a, b) for a, b in box)
    sh.x.read_direct(dest, (row, slice(None), *sel))
    # whole chunks through HDF5's chunk cache; a contiguous layout: the selection
    return touched_chunk_bytes(box, sh.chunks, sh.dtype.itemsize) if sh.chunks else dest.nbytes


def read_samples(files: ShardFiles, items, box, out_x: np.ndarray, out_y: np.ndarray,
                 gshape=None) -> int:
    """Read ``items`` [(shard, row), ...] into out_x[j] (C, d, h, w) and out_y[j] ((K,), or
    (d, h, w) of a label volume); returns bytes fetched from storage (whole chunks touched,
    plus ``y`` of newly opened shards). An item ``(shard, row, view)`` with a nonzero view
    (:mod:`hpcpar.data.augment`; ``gshape`` the sample's global D, H, W) is read flipped or
    turned: the source box its view maps onto ``box``, transformed in place."""
    box = tuple(tuple(int(v) for v in b) for b in box)
    total = 0
    for j, (shard, row, *view) in enumerate(items):
        sh = files.get(shard)
        row, code = int(row), int(view[0]) if view else 0
        src = box if not code else source_box(box, gshape, code)
        sel = tuple(slice(a, b) for a, b in src)
        try:
            if code:
                block = np.empty((out_x.shape[1], *(b - a for a, b in src)), out_x.dtype)
                total += _read_box(files, sh, row, src, block)
                out_x[j] = apply_view(block, code)
            else:
                total += _read_box(files, sh, row, src, out_x[j])
        except (OSError, ValueError, TypeError) as exc:
            raise DataError(f"{files.paths[shard]}: reading sample row {row} failed "
                            f"({str(exc).splitlines()[0]})") from None
        if out_y.ndim == 4:    # a label volume: this rank's box of it, like x
            labels = np.empty(tuple(b - a for a, b in src), out_y.dtype)
            sh.y.read_direct(labels, (row, *sel))
            out_y[j] = apply_view(labels, code) if code else labels
            total += labels.nbytes
        else:
            out_y[j] = sh.y[row]
    total += files.pending_bytes
    files.pending_bytes = 0
    return total
