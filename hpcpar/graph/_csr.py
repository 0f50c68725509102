"""Edge lists <-> in-edge CSR, with the checks every graph entry point shares.

Convention used everywhere in hpcpar.graph: an edge ``(src, dst)`` means ``src -> dst`` (messages
flow from source to destination, PyG's ``edge_index`` order). The CSR is indexed by DESTINATION: row
``i`` lists the sources of ``i``'s in-edges, sorted, without duplicates. So aggregation is
``out = A @ x`` with ``A[i, j] = 1`` for an edge ``j -> i``."""

from __future__ import annotations

import numpy as np

from hpcpar.errors import DataError


def check_edges(edge_index, num_nodes: int, what: str = "edge_index") -> np.ndarray:
    """``edge_index`` as an int64 (2, E) array, or a one-line :class:`DataError`."""
    e = np.asarray(edge_index)
    if e.ndim != 2 or e.shape[0] != 2:
        raise DataError(f"{what}: expected shape (2, E), got {tuple(e.shape)}")
    if not np.issubdtype(e.dtype, np.integer):
        raise DataError(f"{what}: expected integer vertex ids, got {e.dtype}")
    e = e.astype(np.int64, copy=False)
    if e.size:
        lo, hi = int(e.min()), int(e.max())
        if lo < 0 or hi >= num_nodes:
            bad = hi if hi >= num_nodes else lo
            raise DataError(f"{what}: edge points to vertex {bad}, outside 0..{num_nodes - 1} "
                            f"(num_nodes={num_nodes})")
    return e


def check_csr(indptr, indices, rows: int, cols: int, what: str) -> None:
    """A one-line :class:`DataError` unless ``(indptr, indices)`` is a CSR of ``rows x cols``:
    ``rows + 1`` offsets rising from 0 to ``len(indices)``, column ids in ``[0, cols)``."""
    indptr, indices = np.asarray(indptr), np.asarray(indices)
    if indptr.shape != (rows + 1,) or not np.issubdtype(indptr.dtype, np.integer):
        raise DataError(f"{what}: indptr has shape {indptr.shape} ({indptr.dtype}), expected "
                        f"({rows + 1},) integers")
    if indptr[0] != 0 or indptr[-1] != indices.shape[0] or np.any(np.diff(indptr) < 0):
        raise DataError(f"{what}: indptr must rise from 0 to {indices.shape[0]} (the number "
                        f"of entries) and never decrease")
    if indices.size and (indices.min() < 0 or indices.max() >= cols):
        raise DataError(f"{what}: a column id is outside 0..{cols - 1}")


#: the most classes a graph may have: a label of 1e9 would give the model's last layer (and
#: its gradient and optimizer state) a billion rows
MAX_CLASSES = 1 << 20
#: the label of a vertex without one (public citation graphs have them): allowed only on a
#: vertex outside every mask, which the loss and the metrics never read
UNLABELED = -1


def labels_int64(y, what: str) -> np.ndarray:
    """Labels as read from a file, as int64 class ids: a fraction, NaN or inf is refused (it
    would be truncated to another class), and so is anything outside ``-1..MAX_CLASSES-1``
    (DataError naming the vertex and its label; ``what``: the file and field)."""
    y = np.asarray(y)
    if y.dtype == bool:
        return y.astype(np.int64)
    if y.dtype.kind not in "iuf":
        raise DataError(f"{what}: labels of type {y.dtype}, expected integer class ids")
    if y.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(y) | (y != np.round(y))
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(f"{what}: label {y[i]} of vertex {i} is not an integer class id")
    if y.size and (y.min() < UNLABELED or y.max() >= MAX_CLASSES):
        i = int(np.argmin(y) if y.min() < UNLABELED else np.argmax(y))
        raise DataError(f"{what}: label {y[i]:.20g} of vertex {i} is outside the class ids "
                        f"0..{MAX_CLASSES - 1} (or -1: unlabeled)")
    return y.astype(np.int64)


def num_classes_of(y) -> int:
    """The class count of int64 labels: the largest label plus one (at least 1)."""
    return max(int(y.max()) + 1, 1) if np.asarray(y).size else 1


def check_labels(y, num_classes: int, what: str, masks: dict | None = None) -> None:
    """A one-line :class:`DataError` unless every label is a class id in ``[0, num_classes)`` (a
    label outside it would index past the model's outputs) or -1 on a vertex outside every one of
    ``masks`` (unlabeled; without ``masks`` -1 is refused too)."""
    y = np.asarray(y)
    if not 1 <= num_classes <= MAX_CLASSES:
        raise DataError(f"{what}: {num_classes} classes, expected 1..{MAX_CLASSES}")
    if not y.size:
        return
    bad = (y < UNLABELED) | (y >= num_classes)
    unlabeled = y == UNLABELED
    masked = np.zeros(y.shape, bool)
    for m in (masks or {}).values():
        masked |= np.asarray(m, bool)
    bad |= unlabeled & (masked if masks is not None else True)
    if bad.any():
        i = int(np.argmax(bad))
        where = [k for k, m in (masks or {}).items() if np.asarray(m, bool)[i]]
        hint = (f" (vertex {i} is in the {where[0]} mask; -1 marks an unlabeled vertex, "
                f"allowed only outside every mask)" if y[i] == UNLABELED and where else "")
        raise DataError(f"{what}: label {int(y[i])} is outside the class ids "
                        f"0..{num_classes - 1}{hint}")


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique`` by sorting (numpy 2's hash-based unique is several times slower here)."""
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if a.size else a


def edges_to_csr(edge_index, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSR ``(indptr, indices)`` of ``src -> dst`` edges; duplicates removed."""
    e = check_edges(edge_index, num_nodes)
    key = sorted_unique(e[1] * np.int64(num_nodes) + e[0])  # sorted by (dst, src)
    dst, src = np.divmod(key, np.int64(num_nodes))
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_nodes), out=indptr[1:])
    return indptr, src.astype(np.int64)


def row_positions(indptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions in ``indices`` of the entries of ``rows`` (in that order)."""
    lengths = indptr[rows + 1] - indptr[rows]
    starts = np.repeat(indptr[rows] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return starts + np.arange(int(lengths.sum()), dtype=np.int64)


def csr_to_edges(indptr, indices) -> np.ndarray:
    """(2, E) ``src -> dst`` edge list of an in-edge CSR."""
    indptr = np.asarray(indptr, dtype=np.int64)
    dst = np.repeat(np.arange(indptr.shape[0] - 1, dtype=np.int64), np.diff(indptr))
    return np.stack([np.asarray(indices, dtype=np.int64), dst])


def is_symmetric(indptr, indices, num_nodes: int) -> bool:
    """True when every edge ``j -> i`` has its reverse ``i -> j``."""
    e = csr_to_edges(indptr, indices)
    fwd = np.sort(e[1] * np.int64(num_nodes) + e[0])
    rev = np.sort(e[0] * np.int64(num_nodes) + e[1])
    return bool(np.array_equal(fwd, rev))
