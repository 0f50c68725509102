"""Partition a graph into the sharded format (:mod:`hpcpar.graph.shards`) in bounded memory.

What ``hpcpar data graph partition`` runs. Two assignment methods:

* ``metis``: pymetis over the whole structure, read at once. Its memory grows with the edges
  (:func:`metis_memory_estimate`, fitted to measured peaks), so ``auto`` picks it only when
  that estimate fits in half the available memory;
* ``stream``: restreaming LDG (linear deterministic greedy, Stanton & Kliot 2012; Nishimura &
  Ugander 2013): vertices arrive in row blocks, each goes to the part holding most of its
  already-placed neighbours, scaled by ``1 - load/capacity`` (load = in-degree + 1, the
  aggregation work METIS balances too); ties go to the least loaded part. Small batches keep
  the loads current; later passes see the previous pass's placement of every neighbour. It
  holds O(N) integers plus one block of rows, never the edges.

Writing streams the source once more in row blocks, renumbers vertices so each part is a contiguous
id range (source order kept inside a part) and appends each row to its part file: O(N) memory plus a
block, whatever the method. Sources: an hpcpar graph file (read by rows), a text edge list
(bucket-sorted on disk, see :class:`EdgeListSource`), a ``.npz`` (its fields streamed out of the
archive, :class:`NpzSource`), or a PyG ``.pt`` file (its tensors mapped from the file,
:class:`PygSource`; a legacy pre-zip file is imported whole)."""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable

import numpy as np

from hpcpar.data.writer import oserror_line, reserve_space
from hpcpar.errors import DataError
from hpcpar.graph._csr import (
    check_edges,
    check_labels,
    labels_int64,
    num_classes_of,
    row_positions,
    sorted_unique,
)
from hpcpar.graph.format import (
    MASKS,
    NPZ_ERRORS,
    NPZ_FIELDS,
    GraphFile,
    csr_rows_dense,
    npz_checked,
    npz_missing,
    npz_unreadable,
)
from hpcpar.graph.interop import (
    _read_array,
    edge_list_chunks,
    import_graph,
    load_pyg,
    pyg_num_nodes,
    pyg_vertex_fields,
    random_masks,
    warn_repeated_edges,
)
from hpcpar.graph.shards import MANIFEST, PartWriter, write_graph_manifest
from hpcpar.graph.vertex_partition import partition_csr

__all__ = ["METHODS", "peak_rss_bytes", "available_memory", "metis_memory_estimate",
           "ldg_partition", "EdgeListSource", "NpzSource", "PygSource", "open_source",
           "partition_graph"]

METHODS = ("auto", "metis", "stream")
ROW_BLOCK = 1 << 16      # rows read per block
# The partitioning process's peak with METIS (ru_maxrss), fitted to the 1M-vertex / 14.5M-edge
# synthetic graph (1738 MiB measured; docs/guides/gnn.md):
# bytes = EDGE * stored in-edges + NODE * vertices.
METIS_BYTES_PER_EDGE = 100
METIS_BYTES_PER_NODE = 400


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``ru_maxrss``, kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_memory() -> int:
    """Memory the kernel says a new allocation can get (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def metis_memory_estimate(num_nodes: int, num_edges: int) -> int:
    """Predicted peak bytes of partitioning with METIS (structure read whole + METIS)."""
    return METIS_BYTES_PER_EDGE * int(num_edges) + METIS_BYTES_PER_NODE * int(num_nodes)


def ldg_partition(structure_rows: Callable[[int, int], tuple], num_nodes: int,
                  num_edges: int, parts: int, passes: int = 3, slack: float = 0.05,
                  block: int = ROW_BLOCK) -> np.ndarray:
    """Restreaming LDG over row blocks: int64 ``(num_nodes,)`` owners, every part non-empty.

    ``structure_rows(start, stop)`` gives ``(indptr, indices)`` of rows ``[start, stop)``;
    ``num_edges`` (stored in-edges) sets the capacity; the first of ``passes`` places, later ones
    refine; ``slack`` is the allowed imbalance of the load (in-degree + 1) over the mean."""
    owner = np.full(num_nodes, -1, np.int32)
    cap = (1.0 + slack) * (num_nodes + num_edges) / parts
    batch = int(min(4096, max(32, num_nodes // (parts * 64))))
    for _ in range(max(1, passes)):
        load = np.zeros(parts)
        for start in range(0, num_nodes, block):
            ip, idx = structure_rows(start, min(start + block, num_nodes))
            deg = np.diff(ip)
            for b0 in range(0, deg.shape[0], batch):
                b1 = min(b0 + batch, deg.shape[0])
                nb = owner[idx[ip[b0]:ip[b1]]]
                rows = np.repeat(np.arange(b1 - b0), deg[b0:b1])
                ok = nb >= 0
                near = np.bincount(rows[ok] * parts + nb[ok],
                                   minlength=(b1 - b0) * parts).reshape(-1, parts)
                room = np.maximum(1.0 - load / cap, 0.0)
                score = (near + 1e-3) * room
                choice = np.where(score.max(1) > 0, score.argmax(1), np.argmin(load))
                owner[start + b0:start + b1] = choice
                load += np.bincount(choice, weights=deg[b0:b1] + 1, minlength=parts)
    sizes = np.bincount(owner, minlength=parts)
    for p in np.flatnonzero(sizes == 0):   # a part left empty: give it one vertex
        big = int(np.argmax(sizes))
        owner[np.flatnonzero(owner == big)[-1]] = p
        sizes[big] -= 1
        sizes[p] += 1
    return owner.astype(np.int64)


class _BucketedCSR:
    """An in-edge CSR built on disk in bounded memory from a stream of edge blocks, read by rows.

    One pass over the edges appends each block's edges, keyed ``dst * N + src``, to bucket files by
    destination range (and the reversed keys by source range, to tell whether the graph is
    symmetric); each bucket is then sorted and deduplicated alone and kept as a CSR piece. Memory:
    one bucket (about ``bucket_edges`` keys) plus O(N)."""

    num_nodes: int
    y: np.ndarray
    masks: dict

    def _bucket(self, chunks, what: str, buckets: int, workdir: str) -> None:
        n, nb = self.num_nodes, max(1, buckets)
        self.width = -(-n // nb)
        names = {k: [os.path.join(workdir, f"{k}-{b}.bin") for b in range(nb)]
                 for k in ("fwd", "rev")}
        handles = {k: [open(p, "wb") for p in v] for k, v in names.items()}
        try:
            for e in chunks:
                e = check_edges(e, n, what)
                for kind, key_row, other in (("fwd", 1, 0), ("rev", 0, 1)):
                    keys = e[key_row] * np.int64(n) + e[other]
                    bucket = e[key_row] // self.width
                    order = np.argsort(bucket, kind="stable")
                    cuts = np.cumsum(np.bincount(bucket, minlength=nb))[:-1]
                    for b, piece in enumerate(np.split(keys[order], cuts)):
                        piece.tofile(handles[kind][b])
        finally:
            for hs in handles.values():
                for h in hs:
                    h.close()
        self.pieces: list[str] = []
        self.directed, self.num_edges = False, 0
        for b in range(nb):
            fwd = sorted_unique(np.fromfile(names["fwd"][b], np.int64))
            rev = sorted_unique(np.fromfile(names["rev"][b], np.int64))
            self.directed |= not np.array_equal(fwd, rev)
            del rev
            lo, hi = b * self.width, min((b + 1) * self.width, n)
            dst, src = np.divmod(fwd, np.int64(n))
            ip = np.zeros(hi - lo + 1, np.int64)
            np.cumsum(np.bincount(dst - lo, minlength=hi - lo), out=ip[1:])
            stem = os.path.join(workdir, f"csr-{b}")
            np.save(stem + "-indptr.npy", ip)
            np.save(stem + "-indices.npy", src)
            self.pieces.append(stem)
            self.num_edges += int(src.shape[0])
            for k in names:
                os.remove(names[k][b])

    def read_structure_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """In-edge CSR of rows ``[start, stop)`` (``indptr`` from 0, global sources)."""
        ips, idxs = [np.zeros(1, np.int64)], []
        for b in range(start // self.width, -(-stop // self.width)):
            lo = b * self.width
            a, z = max(start, lo) - lo, min(stop, lo + self.width) - lo
            if z <= a:
                continue
            ip = np.load(self.pieces[b] + "-indptr.npy", mmap_mode="r")
            idx = np.load(self.pieces[b] + "-indices.npy", mmap_mode="r")
            seg = np.asarray(ip[a:z + 1])
            idxs.append(np.asarray(idx[seg[0]:seg[-1]]))
            ips.append(seg[1:] - seg[0] + ips[-1][-1])
        return np.concatenate(ips), np.concatenate(idxs) if idxs else np.zeros(0, np.int64)

    def read_structure(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole in-edge CSR (METIS)."""
        return self.read_structure_rows(0, self.num_nodes)

    def _features(self, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError

    def read_rows(self, start: int, stop: int) -> dict:
        """Rows ``[start, stop)`` with features, labels and masks (as ``GraphFile``)."""
        ip, idx = self.read_structure_rows(start, stop)
        return {"indptr": ip, "indices": idx, "x": self._features(start, stop),
                "y": np.asarray(self.y[start:stop], np.int64),
                **{m: self.masks[m][start:stop] for m in MASKS}}

    def close(self) -> None:
        """Nothing to close (the bucket files go with the work folder)."""


class EdgeListSource(_BucketedCSR):
    """A text edge list as rows of an in-edge CSR, built on disk in bounded memory
    (:class:`_BucketedCSR`): ``src dst`` per line, as ``hpcpar data graph import``.

    ``features`` ``(N, F)``: ``.npy`` (memory-mapped, read by rows) or text; ``labels`` ``(N,)``
    class ids (``.npy`` or text), zeros when None; ``split``: random ``(train, val)`` fractions, the
    rest test; ``workdir`` holds the bucket files."""

    def __init__(self, path: str, features: str | None, labels: str | None = None,
                 split: tuple = (0.6, 0.2), seed: int = 0, workdir: str = ".",
                 bucket_edges: int = 1 << 23):
        if features is None:
            raise DataError(f"{path}: an edge list needs --features (N x F, .npy or text)")
        self.x = np.load(features, mmap_mode="r") if str(features).endswith(".npy") and \
            os.path.isfile(features) else _read_array(features, "features")
        if self.x.ndim == 1:
            self.x = self.x.reshape(-1, 1)
        n = self.num_nodes = int(self.x.shape[0])
        self.num_features = int(self.x.shape[1])
        self.y = np.zeros(n, np.int64) if labels is None else \
            labels_int64(_read_array(labels, "labels").reshape(-1), str(labels))
        if self.y.shape[0] != n:
            raise DataError(f"{labels}: {self.y.shape[0]} labels for {n} vertices (rows of "
                            f"{features})")
        self.num_classes = num_classes_of(self.y)
        self.masks = random_masks(n, split, seed)
        check_labels(self.y, self.num_classes, str(labels), self.masks)
        self.name = os.path.splitext(os.path.basename(str(path)))[0]
        self._bucket(edge_list_chunks(path), str(path),
                     -(-os.path.getsize(path) // (8 * bucket_edges)), workdir)

    def _features(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.x[start:stop], np.float32)


class _Npy:
    """A ``.npy`` file read by slices with plain reads, never memory-mapped: a block is read
    and freed, so the process keeps one block resident (a mapping keeps every page it
    touched). ``x[a:b]`` of a 1-D array; :meth:`columns` of a ``(2, E)`` one."""

    def __init__(self, path: str, what: str):
        self.path = path
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            self.shape, self.fortran, self.dtype = read(f)
            self.offset = f.tell()
        if self.dtype.hasobject:
            raise DataError(f"{what}: holds Python objects (a pickle), expected numbers")
        self.ndim = len(self.shape)

    def _flat(self, lo: int, hi: int) -> np.ndarray:
        return np.fromfile(self.path, self.dtype, count=max(0, hi - lo),
                           offset=self.offset + lo * self.dtype.itemsize)

    def __getitem__(self, key: slice) -> np.ndarray:
        lo, hi, _ = key.indices(self.shape[0])
        return self._flat(lo, hi)

    def whole(self) -> np.ndarray:
        n = int(np.prod(self.shape))
        out = self._flat(0, n)
        return out.reshape(self.shape, order="F" if self.fortran else "C")

    def columns(self, lo: int, hi: int) -> np.ndarray:
        """Columns ``[lo, hi)`` of a ``(2, E)`` array."""
        if self.fortran:
            return self._flat(2 * lo, 2 * hi).reshape(hi - lo, 2).T
        e = self.shape[1]
        return np.stack([self._flat(lo, hi), self._flat(e + lo, e + hi)])


class NpzSource(_BucketedCSR):
    """A Planetoid-style ``.npz`` (the fields of :func:`hpcpar.graph.format.import_npz`) in bounded
    memory: each field is copied out of the archive into ``workdir`` by streaming (stored or
    compressed alike); the edges go into the on-disk CSR in column blocks (:class:`_BucketedCSR`)
    and the CSR features are read by rows. O(N) memory plus a block, where importing it whole held
    every edge and feature at once. DataError: an unreadable archive or a missing or malformed
    field."""

    def __init__(self, path: str, workdir: str = ".", bucket_edges: int = 1 << 23,
                 block: int = 1 << 20):
        try:
            with zipfile.ZipFile(path) as z:
                members = {os.path.splitext(m)[0]: m for m in z.namelist()}
                npz_missing(path, members)
                f: dict[str, _Npy] = {}
                for k in NPZ_FIELDS:
                    out = os.path.join(workdir, f"npz-{k}.npy")
                    with z.open(members[k]) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 22)
                    f[k] = _Npy(out, f"{path}: {k}")
        except NPZ_ERRORS as exc:
            raise npz_unreadable(path, exc) from None
        small = {k: f[k].whole() for k in ("y", "x_shape", "x_indptr", "train_idx",
                                           "val_idx", "test_idx")}   # O(N) each
        n, self.masks = npz_checked(path, small)
        self.num_nodes, self.num_features = n, int(small["x_shape"][1])
        self.y = small["y"]
        self.num_classes = num_classes_of(self.y)
        self.name = os.path.splitext(os.path.basename(str(path)))[0]
        self._x = (small["x_indptr"], f["x_indices"], f["x_data"])
        e = f["edge_index"]
        if e.ndim != 2 or e.shape[0] != 2:
            raise DataError(f"{path}: edge_index: expected shape (2, E), got {e.shape}")
        self._bucket((e.columns(i, min(i + block, e.shape[1]))
                      for i in range(0, e.shape[1], block)),
                     f"{path}: edge_index", -(-e.shape[1] // bucket_edges), workdir)

    def _features(self, start: int, stop: int) -> np.ndarray:
        return csr_rows_dense(*self._x, start, stop, self.num_features,
                              f"{self.name}.npz: x_indptr/x_indices/x_data")


def _file_spans(path: str) -> list[tuple[int, int]]:
    """Address ranges where the file ``path`` is mapped into this process (/proc/self/maps)."""
    real, spans = os.path.realpath(path), []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == real:
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                spans.append((lo, hi))
    return spans


def _drop_pages(t, spans: list[tuple[int, int]]) -> None:
    """Give back the pages of a file-mapped tensor's range once read (``madvise
    MADV_DONTNEED``), so the process keeps one block resident instead of every page it read.
    Only inside the file's own mapping (``spans``): there a dropped page is read again from
    the file if touched again; a tensor the unpickler built in memory would come back zeros."""
    if t.numel() == 0 or not t.is_contiguous():
        return
    page = resource.getpagesize()
    lo = t.data_ptr() // page * page
    hi = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    if any(a <= lo and hi <= b for a, b in spans):
        _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class PygSource(_BucketedCSR):
    """A PyG ``Data`` saved with ``torch.save`` (``.pt``) in bounded memory: the tensors are mapped
    from the file (``torch.load(mmap=True)``, through the same safe unpickling as
    :func:`~hpcpar.graph.interop.load_pyg`), the edges go into the on-disk CSR in column blocks
    (:class:`_BucketedCSR`) and the features are read by rows, each block's pages given back after
    reading. O(N) memory plus a block, where importing the file whole held every edge and feature at
    once. The same fields and rules as :func:`~hpcpar.graph.interop.pyg_arrays` (masks the file
    lacks: a seeded random split). DataError: an unreadable or unsafe file, or a missing or
    malformed field."""

    def __init__(self, path: str, workdir: str = ".", split: tuple = (0.6, 0.2),
                 seed: int = 0, trust_pickle: bool = False, bucket_edges: int = 1 << 23,
                 block: int = 1 << 20):
        data = load_pyg(path, trust_pickle, mmap=True)
        n = self.num_nodes = pyg_num_nodes(data, path)
        x, e = data.x, data.edge_index
        if e.dim() != 2 or e.shape[0] != 2:
            raise DataError(f"{path}: edge_index: expected shape (2, E), got "
                            f"{tuple(e.shape)}")
        self.y, self.masks = pyg_vertex_fields(data, n, path)
        self.num_features = int(x.shape[1])
        if not any(m.any() for m in self.masks.values()):
            self.masks = random_masks(n, split, seed)
        self.num_classes = num_classes_of(self.y)
        check_labels(self.y, self.num_classes, f"{path}: y", self.masks)
        self.name = os.path.splitext(os.path.basename(str(path)))[0]
        self._x, self._spans = x.detach(), _file_spans(path)
        e, edges = e.detach(), int(e.shape[1])

        def chunks():
            for i in range(0, edges, block):
                cols = [e[r, i:min(i + block, edges)] for r in (0, 1)]
                yield np.stack([c.numpy().astype(np.int64) for c in cols])
                for c in cols:
                    _drop_pages(c, self._spans)

        self._bucket(chunks(), f"{path}: edge_index", -(-edges // bucket_edges), workdir)
        warn_repeated_edges(path, edges - self.num_edges)

    def _features(self, start: int, stop: int) -> np.ndarray:
        rows = self._x[start:stop]
        out = rows.numpy().astype(np.float32)   # a copy, whatever the stored dtype
        _drop_pages(rows, self._spans)
        return out


class _FileSource:
    """A graph file read by rows, with ``num_edges`` (what the partitioner reads)."""

    def __init__(self, path):
        self.gf = GraphFile(path)
        for k in ("num_nodes", "num_features", "num_classes", "directed", "name"):
            setattr(self, k, getattr(self.gf, k))
        self.num_edges = int(self.gf.f.attrs.get("num_edges", 0)) or int(
            self.gf.read_structure_rows(self.num_nodes, self.num_nodes)[0][-1])
        self.read_structure_rows = self.gf.read_structure_rows
        self.read_structure = self.gf.read_structure
        self.read_rows = self.gf.read_rows

    def close(self) -> None:
        self.gf.close()


def open_source(src: str, workdir: str, features=None, labels=None, split=(0.6, 0.2),
                seed: int = 0, trust_pickle: bool = False):
    """Open a graph for partitioning: an hpcpar graph file (``.h5``/``.hdf5``), an ``.npz``
    (streamed), a PyG ``.pt``/``.pth`` (mapped; a legacy non-zip file is imported whole to
    ``workdir`` first) or a text edge list. DataError: a missing or unreadable source."""
    src = str(src)
    if not os.path.exists(src):
        raise DataError(f"{src}: no such file")
    if src.endswith((".h5", ".hdf5")):
        return _FileSource(src)
    if src.endswith(".npz"):
        return NpzSource(src, workdir)
    if src.endswith((".pt", ".pth")) and zipfile.is_zipfile(src):
        return PygSource(src, workdir, split, seed, trust_pickle)
    if src.endswith((".pt", ".pth")):   # the legacy (pre-1.6) format cannot be mapped
        tmp = os.path.join(workdir, "imported.h5")
        import_graph(src, tmp, split=split, seed=seed, trust_pickle=trust_pickle)
        return _FileSource(tmp)
    return EdgeListSource(src, features, labels, split, seed, workdir)


def _renumber(owner: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, new_id)``: part ``p`` gets ids ``[offsets[p], offsets[p+1])`` in source order."""
    offsets = np.zeros(parts + 1, np.int64)
    np.cumsum(np.bincount(owner, minlength=parts), out=offsets[1:])
    new_id = np.empty(owner.shape[0], np.int64)
    new_id[np.argsort(owner, kind="stable")] = np.arange(owner.shape[0], dtype=np.int64)
    return offsets, new_id


def _write_parts(source, out: str, owner: np.ndarray, parts: int, force: bool,
                 block: int) -> tuple[np.ndarray, list, int]:
    """Stream the rows into their parts, renumbered; ``(offsets, shard entries, cut edges)``."""
    offsets, new_id = _renumber(owner, parts)
    n = source.num_nodes
    parent = os.path.dirname(os.path.abspath(out))
    reserve_space(out, parent, PartWriter.bytes_needed(n, source.num_edges, source.num_features,
                                                       parts), "the partitioned graph")
    writer = PartWriter(out, parts, source.num_features, force)
    try:
        cut = _fill_parts(source, writer, owner, new_id, block)
    except OSError as exc:
        writer.abort()
        raise DataError(f"{out}: cannot write the parts ({oserror_line(exc)}); the partial "
                        f"part files are removed") from None
    return offsets, writer.close(offsets), cut


def _fill_parts(source, writer: PartWriter, owner: np.ndarray, new_id: np.ndarray,
                block: int) -> int:
    """Append every row block to its parts; the cut edges."""
    cut, n = 0, source.num_nodes
    for start in range(0, n, block):
        stop = min(start + block, n)
        blk = source.read_rows(start, stop)
        ip, deg = blk["indptr"], np.diff(blk["indptr"])
        dst = np.repeat(np.arange(stop - start), deg)
        cut += int(np.count_nonzero(owner[blk["indices"]] != owner[start + dst]))
        src = new_id[blk["indices"]]
        src = src[np.lexsort((src, dst))]          # each row sorted by its NEW source ids
        own = owner[start:stop]
        for p in np.unique(own):
            rows = np.flatnonzero(own == p)
            rip = np.zeros(rows.shape[0] + 1, np.int64)
            np.cumsum(deg[rows], out=rip[1:])
            writer.append(int(p), rip, src[row_positions(ip, rows)], blk["x"][rows],
                          blk["y"][rows], {m: blk[m][rows] for m in MASKS}, start + rows)
    return cut


def partition_graph(src: str, out: str, parts: int, method: str = "auto", seed: int = 0,
                    passes: int = 3, memory_limit: int | None = None, force: bool = False,
                    features: str | None = None, labels: str | None = None,
                    split: tuple = (0.6, 0.2), trust_pickle: bool = False,
                    block: int = ROW_BLOCK) -> dict:
    """Partition graph ``src`` (an hpcpar graph file, ``.npz``, PyG ``.pt`` or a text edge list)
    into ``parts`` parts (the ranks that will train on it) and write the sharded graph format to
    ``out``; returns the manifest (with ``partition``: method, edge cut, balance, seconds, peak
    memory).

    ``method``: ``"metis"``, ``"stream"`` or ``"auto"`` (METIS when :func:`metis_memory_estimate` is
    at most half of ``memory_limit``, by default the available memory). ``seed`` seeds METIS (and
    the random split of an edge list's masks). ``features``, ``labels`` and ``split`` (random
    ``(train, val)`` fractions) are for edge lists; ``trust_pickle`` unpickles PyG files beyond
    PyG's classes. DataError: an unreadable source, ``parts`` out of range, an unknown method, an
    existing output without ``force``, or METIS missing."""
    if method not in METHODS:
        raise DataError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    if os.path.exists(os.path.join(out, MANIFEST)) and not force:
        raise DataError(f"{out}: already holds a dataset (pass --force to replace it)")
    t0 = time.perf_counter()
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".partition-", dir=parent)
    except OSError as exc:
        raise DataError(f"{out}: cannot write there ({oserror_line(exc)})") from None
    try:
        source = open_source(src, work, features, labels, split, seed, trust_pickle)
        try:
            n, e = source.num_nodes, source.num_edges
            if not 1 <= parts <= n:
                raise DataError(f"--parts {parts}: expected 1..{n} (at least one vertex per "
                                "part)")
            estimate = metis_memory_estimate(n, e)
            budget = memory_limit or available_memory()
            if method == "auto":
                method = "metis" if estimate <= budget // 2 else "stream"
            if method == "metis":
                indptr, indices = source.read_structure()
                owner = partition_csr(indptr, indices, parts, "metis", seed,
                                      symmetric=not source.directed)
                del indptr, indices
            else:
                owner = ldg_partition(source.read_structure_rows, n, e, parts, passes,
                                      block=block)
            t_assign = time.perf_counter() - t0
            offsets, shards, cut = _write_parts(source, out, owner, parts, force, block)
            load = np.zeros(parts)
            for s in range(0, n, block):   # per-part load, as the partitioner balances it
                ip, _ = source.read_structure_rows(s, min(s + block, n))
                load += np.bincount(owner[s:s + ip.shape[0] - 1], weights=np.diff(ip) + 1,
                                    minlength=parts)
            fields = {"name": source.name, "source": str(src), "num_nodes": n,
                      "num_edges": e, "num_features": source.num_features,
                      "num_classes": source.num_classes, "directed": bool(source.directed),
                      "parts": parts, "offsets": offsets.tolist()}
        finally:
            source.close()
    except OSError as exc:   # the work files (a full disk, a quota): one line
        raise DataError(f"{out}: cannot partition {src} ({oserror_line(exc)})") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fields["partition"] = {
        "method": method, "seed": seed, "passes": passes if method == "stream" else None,
        "edge_cut": cut, "cut_fraction": cut / e if e else 0.0,
        "balance": float(load.max() / load.mean()),
        "metis_estimate_bytes": estimate, "memory_budget_bytes": int(budget),
        "assign_seconds": round(t_assign, 3),
        "seconds": round(time.perf_counter() - t0, 3), "peak_rss_bytes": peak_rss_bytes()}
    fields["shards"] = shards
    try:
        return write_graph_manifest(out, fields)
    except OSError as exc:
        raise DataError(f"{out}: cannot write {MANIFEST} ({oserror_line(exc)}); the parts are "
                        f"not usable without it") from None
