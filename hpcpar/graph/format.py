"""The hpcpar graph file: one HDF5 file per graph (format version 1).

Layout (``N`` vertices, ``E`` edges, ``F`` features)::

    /                 attrs: format="hpcpar-graph", version=1, num_nodes=N, num_edges=E,
                             num_features=F, num_classes, directed (bool), name, source
    /csr/indptr       (N+1,) int64   in-edge CSR, row = DESTINATION vertex
    /csr/indices      (E,)   int64   sources of each row's in-edges, sorted, no duplicates
      (or, instead of /csr: /edge_index (2, E) int64, row 0 source, row 1 destination)
    /features         (N, F) float32 dense
      (or a group /features with indptr, indices, data and attr shape=(N, F): CSR features)
    /labels           (N,)   int64   class id
    /masks/train      (N,)   bool    (also /masks/val, /masks/test)

Readers read row blocks (``[start, stop)`` hyperslabs), so each rank only touches its block."""

from __future__ import annotations

import os
import tempfile
import zipfile

import numpy as np

from hpcpar.data.writer import oserror_line, reserve_space
from hpcpar.errors import DataError
from hpcpar.graph._csr import (
    check_csr,
    check_edges,
    check_labels,
    edges_to_csr,
    is_symmetric,
    labels_int64,
    num_classes_of,
)

__all__ = ["FORMAT", "MASKS", "NPZ_FIELDS", "write_graph", "check_graph_out", "GraphFile",
           "csr_rows_dense", "NPZ_ERRORS", "npz_unreadable", "npz_missing", "npz_checked",
           "import_npz", "bundled"]

FORMAT = "hpcpar-graph"
VERSION = 1
MASKS = ("train", "val", "test")


def write_graph(path: str | os.PathLike, num_nodes: int, x: np.ndarray | tuple,
                y: np.ndarray, masks: dict, edge_index: np.ndarray | None = None,
                csr: tuple[np.ndarray, np.ndarray] | None = None,
                directed: bool = False, name: str = "", source: str = "",
                num_classes: int | None = None) -> None:
    """Write a graph file (format version 1: ``docs/guides/gnn.md``).

    ``x``: dense ``(N, F)`` features, or CSR ``(indptr, indices, data, shape)``; ``y``: ``(N,)``
    class ids (-1: unlabeled, only on a vertex outside every mask); ``masks``: ``{"train": ...,
    "val": ..., "test": ...}``, boolean ``(N,)``. The edges: ``edge_index`` ``(2, E)``, ``src ->
    dst``, or the in-edge ``csr`` ``(indptr, indices)``. ``source``: free text; ``num_classes``:
    ``max(y) + 1`` when None. DataError: an edge out of range, CSR features that are not a CSR of
    ``N`` rows, a label outside ``[0, num_classes)`` (or -1 on a masked vertex), or a failed write
    (a full disk: nothing is left behind)."""
    if csr is None:
        indptr, indices = edges_to_csr(edge_index, num_nodes)
    else:
        indptr, indices = (np.asarray(a, dtype=np.int64) for a in csr)
    y = labels_int64(y, f"{path}: labels")
    if num_classes is None:
        num_classes = num_classes_of(y)
    check_labels(y, num_classes, f"{path}: labels", masks)
    if isinstance(x, tuple):
        check_csr(x[0], x[1], num_nodes, int(x[3][1]), f"{path}: CSR features")
        fields: dict[str, np.ndarray] = {
            "features/indptr": np.asarray(x[0], dtype=np.int64),
            "features/indices": np.asarray(x[1], dtype=np.int64),
            "features/data": np.asarray(x[2], dtype=np.float32)}
        width = int(x[3][1])
    else:
        fields = {"features": np.asarray(x, dtype=np.float32)}
        width = int(fields["features"].shape[1])
    fields.update({"csr/indptr": indptr, "csr/indices": indices, "labels": y,
                   **{f"masks/{m}": np.asarray(masks[m], dtype=bool) for m in MASKS}})
    attrs = dict(format=FORMAT, version=VERSION, num_nodes=num_nodes,
                 num_edges=int(indices.shape[0]), directed=bool(directed), name=name,
                 source=source, num_classes=int(num_classes), num_features=width)
    _write_h5_atomic(str(path), fields, attrs,
                     None if not isinstance(x, tuple) else np.asarray(x[3], dtype=np.int64))


def _write_h5_atomic(path: str, fields: dict, attrs: dict, csr_shape) -> None:
    """Write the graph file beside ``path`` and rename it into place: the space is claimed
    first (HDF5 crashes on a full disk, :func:`hpcpar.data.writer.reserve_space`), and a
    failed write leaves no partial file and the old one (``--force``) intact."""
    import h5py

    path = os.path.abspath(path)
    need = sum(a.nbytes for a in fields.values())
    need += need // 100 + (1 << 20)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.partial-",
                                   dir=os.path.dirname(path))
    except OSError as exc:
        raise DataError(f"{path}: cannot write the graph file ({oserror_line(exc)})") from None
    os.close(fd)
    try:
        reserve_space(path, os.path.dirname(path), need, "the graph file")
        with h5py.File(tmp, "w") as f:
            f.attrs.update(attrs)
            for key, value in fields.items():
                f[key] = value
            if csr_shape is not None:
                f["features"].attrs["shape"] = csr_shape
        os.replace(tmp, path)
    except OSError as exc:
        raise DataError(f"{path}: cannot write the graph file ({oserror_line(exc)}); nothing "
                        f"was written") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def check_graph_out(out: str | os.PathLike, force: bool) -> None:
    """Refuse (read-only) to replace an existing ``out`` without ``force``, and with it
    anything but a graph file hpcpar wrote (``format="hpcpar-graph"``): a DataError naming
    ``out`` and what to do."""
    out = str(out)
    if not os.path.lexists(out):
        return
    if not force:
        raise DataError(f"{out}: already exists (use --force to replace it)")
    if os.path.islink(out) or not os.path.isfile(out):
        raise DataError(f"{out}: exists and is not a regular file; --force replaces only a "
                        f"graph file hpcpar made")
    try:
        GraphFile(out).close()
    except DataError:
        raise DataError(f"{out}: not an hpcpar graph file; --force replaces only a graph file "
                        f"hpcpar made: remove it yourself or choose another OUT") from None


class GraphFile:
    """A validated, open graph file; read row blocks with ``read_rows``. A context manager
    (closes the file). DataError: a missing file, not HDF5, or a missing or malformed field
    (naming the field)."""

    def __init__(self, path: str | os.PathLike):
        import h5py

        self.path = str(path)
        try:
            self.f = h5py.File(self.path, "r")
        except FileNotFoundError:
            raise DataError(f"{self.path}: no such graph file") from None
        except OSError as exc:
            raise DataError(f"{self.path}: not an HDF5 file ({exc})") from None
        try:
            self._validate()
        except Exception:
            self.f.close()
            raise
        self._edge_csr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Close the file."""
        self.f.close()

    def _fail(self, msg: str):
        raise DataError(f"{self.path}: {msg} (hpcpar graph format v{VERSION})")

    def _int_attr(self, name: str, low: int) -> int:
        """A root attribute that must be an integer >= ``low`` (absent: ``low``)."""
        v = self.f.attrs.get(name, low)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < low:
            self._fail(f"attribute {name}={v!r}, expected an integer >= {low}")
        return int(v)

    def _need(self, name: str, shape=None):
        if name not in self.f:
            self._fail(f"missing field '/{name}'")
        ds = self.f[name]
        if getattr(ds, "ndim", None) != 1:       # every field read by rows is a 1-D array
            self._fail(f"field '/{name}' is not a 1-D array")
        if shape is not None and tuple(ds.shape) != tuple(shape):
            self._fail(f"field '/{name}' has shape {tuple(ds.shape)}, expected {tuple(shape)}")
        return ds

    def _validate(self) -> None:
        a = self.f.attrs
        if not isinstance(a.get("format"), str) or a.get("format") != FORMAT:
            self._fail(f"attribute format={a.get('format')!r}, expected {FORMAT!r}")
        if self._int_attr("version", 0) > VERSION:
            self._fail(f"file version {a.get('version')} is newer than this reader")
        if "num_nodes" not in a:
            self._fail("missing attribute 'num_nodes'")
        n = self.num_nodes = self._int_attr("num_nodes", 0)
        self.directed = a.get("directed", False)
        if not isinstance(self.directed, (bool, np.bool_)):
            self._fail(f"attribute directed={self.directed!r}, expected a boolean")
        self.directed = bool(self.directed)
        self.name = str(a.get("name", ""))
        if "csr" in self.f:
            self._need("csr/indptr", (n + 1,))
            self._need("csr/indices")
        elif "edge_index" in self.f:
            if self.f["edge_index"].ndim != 2 or self.f["edge_index"].shape[0] != 2:
                self._fail(f"field '/edge_index' has shape {self.f['edge_index'].shape}, "
                           "expected (2, E)")
        else:
            self._fail("missing field '/csr' (or '/edge_index')")
        if "features" not in self.f:
            self._fail("missing field '/features'")
        if hasattr(self.f["features"], "keys"):
            for k in ("indptr", "indices", "data"):
                self._need(f"features/{k}")
            if "shape" not in self.f["features"].attrs:
                self._fail("field '/features' (CSR) has no 'shape' attribute")
            attr = np.asarray(self.f["features"].attrs["shape"])
            if attr.shape != (2,) or attr.dtype.kind not in "iu" or attr.min() < 0:
                self._fail(f"field '/features' (CSR) has shape attribute {attr.tolist()!r}, "
                           "expected two non-negative integers (N, F)")
            shape = tuple(int(s) for s in attr)
            self._need("features/indptr", (shape[0] + 1,))
        else:
            shape = self.f["features"].shape
        if len(shape) != 2 or shape[0] != n:
            self._fail(f"field '/features' has shape {tuple(shape)}, expected ({n}, F)")
        self.num_features = int(shape[1])
        labels = self._need("labels", (n,))[()]
        masks = {m: self._need(f"masks/{m}", (n,))[()] for m in MASKS}
        self.num_classes = self._int_attr("num_classes", 1) if "num_classes" in a else \
            num_classes_of(labels)
        check_labels(labels, self.num_classes, f"{self.path}: /labels", masks)

    # ---- reading ------------------------------------------------------------------------
    def _csr_arrays(self):
        if "csr" in self.f:
            return self.f["csr/indptr"], self.f["csr/indices"]
        if self._edge_csr is None:
            e = check_edges(self.f["edge_index"][()], self.num_nodes,
                            f"{self.path}: /edge_index")
            self._edge_csr = edges_to_csr(e, self.num_nodes)
        return self._edge_csr

    def read_structure(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole in-edge CSR ``(indptr, indices)`` (for partitioning); DataError for an
        edge from a vertex out of range."""
        indptr, indices = self._csr_arrays()
        return self._checked(np.asarray(indptr[:], np.int64), np.asarray(indices[:], np.int64))

    def _checked(self, indptr, indices):
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_nodes):
            bad = int(indices.max() if indices.max() >= self.num_nodes else indices.min())
            self._fail(f"/csr/indices has an edge from vertex {bad}, outside "
                       f"0..{self.num_nodes - 1}")
        if np.any(np.diff(indptr) < 0):
            self._fail("/csr/indptr is not non-decreasing")
        return indptr, indices

    def read_structure_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The in-edge CSR of rows ``[start, stop)`` only (``indptr`` from 0, global source
        ids): what a streaming partitioner reads, without the features."""
        indptr_ds, indices_ds = self._csr_arrays()
        ip = np.asarray(indptr_ds[start:stop + 1], np.int64)
        idx = np.asarray(indices_ds[int(ip[0]):int(ip[-1])], np.int64) if stop > start \
            else np.zeros(0, np.int64)
        return self._checked(ip - ip[0], idx)

    def read_rows(self, start: int, stop: int) -> dict:
        """Vertex rows ``[start, stop)`` (hyperslabs): ``indptr`` (from 0), ``indices``
        (global source ids), ``x`` (dense float32), ``y``, and the ``train``/``val``/``test``
        masks of the block."""
        ip, idx = self.read_structure_rows(start, stop)
        out = {"indptr": ip, "indices": idx, "x": self._read_features(start, stop),
               "y": np.asarray(self.f["labels"][start:stop], np.int64)}
        for m in MASKS:
            out[m] = np.asarray(self.f[f"masks/{m}"][start:stop], bool)
        return out

    def _read_features(self, start: int, stop: int) -> np.ndarray:
        fs = self.f["features"]
        if not hasattr(fs, "keys"):
            return np.asarray(fs[start:stop], np.float32)
        return csr_rows_dense(fs["indptr"], fs["indices"], fs["data"], start, stop,
                              self.num_features, f"{self.path}: /features")


def csr_rows_dense(indptr, indices, data, start: int, stop: int, width: int,
                   what: str) -> np.ndarray:
    """Rows ``[start, stop)`` of CSR features as a dense float32 block, reading only those
    rows' entries (the arrays may be HDF5 datasets or memory maps)."""
    ip = np.asarray(indptr[start:stop + 1], np.int64)
    cols = np.asarray(indices[int(ip[0]):int(ip[-1])], np.int64)
    vals = np.asarray(data[int(ip[0]):int(ip[-1])], np.float32)
    check_csr(ip - ip[0], cols, stop - start, width, f"{what} rows {start}..{stop - 1}")
    dense = np.zeros((stop - start, width), np.float32)
    rows = np.repeat(np.arange(stop - start), np.diff(ip))
    dense[rows, cols] = vals
    return dense


#: the fields of a Planetoid-style ``.npz`` (:func:`import_npz`)
NPZ_FIELDS = ("edge_index", "x_indptr", "x_indices", "x_data", "x_shape", "y",
              "train_idx", "val_idx", "test_idx")


#: what reading a damaged ``.npz`` raises (:func:`npz_unreadable` says it in one line)
NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def npz_unreadable(src, exc: BaseException) -> DataError:
    """The one line for an ``.npz`` that cannot be read (a :class:`DataError` raised while
    reading it already is one)."""
    if isinstance(exc, DataError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return DataError(f"{src}: no such file")
    return DataError(f"{src}: not a readable .npz (truncated or damaged: "
                     f"{type(exc).__name__})")


def npz_missing(src, names) -> None:
    """A one-line error when the archive lacks one of :data:`NPZ_FIELDS`."""
    missing = [k for k in NPZ_FIELDS if k not in names]
    if missing:
        raise DataError(f"{src}: missing field(s) {', '.join(missing)} "
                        f"(expected {', '.join(NPZ_FIELDS)})")


def npz_checked(src, d) -> tuple[int, dict]:
    """``(vertices, masks)`` of an ``.npz``'s fields ``d`` (arrays or memory maps): the
    labels, feature shape and split indices checked, one line naming the field if not."""
    n = int(d["y"].shape[0])
    d["y"] = labels_int64(d["y"], f"{src}: y")
    shape = np.asarray(d["x_shape"])
    if shape.shape != (2,) or not np.issubdtype(shape.dtype, np.integer) or shape[0] != n:
        raise DataError(f"{src}: x_shape is {shape.tolist()}, expected [{n}, features]")
    masks = {}
    for m in MASKS:
        idx = np.asarray(d[f"{m}_idx"])
        if not np.issubdtype(idx.dtype, np.integer) or (idx.size and (
                idx.min() < 0 or idx.max() >= n)):
            raise DataError(f"{src}: {m}_idx holds a vertex outside 0..{n - 1}")
        mask = np.zeros(n, bool)
        mask[idx] = True
        masks[m] = mask
    check_labels(d["y"], num_classes_of(d["y"]), f"{src}: y", masks)
    return n, masks


def import_npz(src: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Convert a Planetoid-style ``.npz`` to a graph file (read whole: for a large one,
    ``hpcpar data graph partition`` streams it, :class:`hpcpar.graph.stream_partition.NpzSource`).

    ``src`` holds ``edge_index``, CSR features ``x_indptr``/``x_indices``/``x_data``/``x_shape``,
    ``y`` and ``train_idx``/``val_idx``/``test_idx``. Returns a summary: vertices, edges, features,
    classes and split sizes. DataError: a missing or unreadable file or field."""
    try:
        with np.load(src, allow_pickle=False) as npz:
            npz_missing(src, npz.files)
            d = {k: npz[k] for k in NPZ_FIELDS}
    except NPZ_ERRORS as exc:
        raise npz_unreadable(src, exc) from None
    n, masks = npz_checked(src, d)
    y = d["y"]
    e = check_edges(d["edge_index"], n, f"{src}: edge_index")
    indptr, indices = edges_to_csr(e, n)
    directed = not is_symmetric(indptr, indices, n)
    write_graph(out, n, (d["x_indptr"], d["x_indices"], d["x_data"], d["x_shape"]), y, masks,
                csr=(indptr, indices), directed=directed,
                name=os.path.splitext(os.path.basename(str(src)))[0], source=str(src))
    return {"nodes": n, "edges": int(indices.shape[0]), "features": int(d["x_shape"][1]),
            "classes": num_classes_of(y), "directed": directed,
            **{m: int(masks[m].sum()) for m in MASKS}}


def bundled(name: str) -> str:
    """The ``.npz`` path (for [import_npz][hpcpar.graph.format.import_npz]) of a dataset shipped
    with hpcpar: ``"cora"`` (Planetoid Cora, MIT licence, T. Kipf)."""
    return os.path.join(os.path.dirname(__file__), "datasets", f"{name}.npz")
