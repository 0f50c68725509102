"""Edge lists <-> in-edge CSR, with the checks every graph entry point shares.

Convention used everywhere in hpcpar.graph: an edge ``(src, dst)`` means ``src -> dst``
(messages flow from source to destination, PyG's ``edge_index`` order). The CSR is indexed by
DESTINATION: row ``i`` lists the sources of ``i``'s in-edges, sorted, without duplicates. So
aggregation is ``out = A @ x`` with ``A[i, j] = 1`` for an edge ``j -> i``.
"""

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


def check_labels(y, num_classes: int, what: str) -> None:
    """A one-line :class:`DataError` unless every label is a class id in
    ``[0, num_classes)``: a label outside it would index past the model's outputs."""
    y = np.asarray(y)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        bad = int(y.min() if y.min() < 0 else y.max())
        raise DataError(f"{what}: label {bad} is outside the class ids 0..{num_classes - 1}")


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
