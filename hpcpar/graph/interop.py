"""Graphs from PyTorch Geometric and from plain files.

:func:`pyg_arrays` reads a ``torch_geometric.data.Data`` by its attributes (``edge_index``, ``x``,
``y``, ``train_mask``/``val_mask``/``test_mask``, ``num_nodes``), so this module never imports PyG;
``DistGraph.from_pyg`` partitions one, ``hpcpar data graph import`` converts a saved one
(``torch.save(data, "g.pt")``) or an edge list plus a features file to a graph file. PyG's edge
direction convention is kept: ``edge_index[0]`` is the source, ``[1]`` the target, and a layer
aggregates over in-edges (``flow="source_to_target"``). hpcpar graphs are simple: repeated edges are
merged (with a warning), where PyG's layers would count each copy."""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from hpcpar.errors import DataError
from hpcpar.graph._csr import (
    check_edges,
    edges_to_csr,
    is_symmetric,
    labels_int64,
    num_classes_of,
)
from hpcpar.graph.format import MASKS, write_graph

__all__ = ["pyg_arrays", "pyg_num_nodes", "pyg_vertex_fields", "warn_repeated_edges", "load_pyg",
           "edge_list_chunks", "random_masks", "import_graph"]


def _np(value, dtype=None):
    value = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    return value.astype(dtype) if dtype is not None else value


def pyg_num_nodes(data: Any, where: str) -> int:
    """Vertices of a PyG ``Data`` after checking that ``edge_index`` and a 2-D ``x`` with one
    row per vertex are there (shapes only: nothing is read)."""
    for name in ("edge_index", "x"):
        if getattr(data, name, None) is None:
            raise DataError(f"{where}: no '{name}' (a PyG Data needs edge_index and x)")
    shape = tuple(np.shape(data.x))
    if len(shape) != 2:
        raise DataError(f"{where}: 'x' has shape {shape}, expected (num_nodes, features)")
    n = int(getattr(data, "num_nodes", None) or shape[0])
    if shape[0] != n:
        raise DataError(f"{where}: 'x' has {shape[0]} rows, num_nodes is {n}")
    return n


def pyg_vertex_fields(data: Any, n: int, where: str) -> tuple[np.ndarray, dict]:
    """``y`` (zeros when absent) and the train/val/test masks (all False when absent) of a
    PyG ``Data`` with ``n`` vertices, checked: O(N) each."""
    y = getattr(data, "y", None)
    y = np.zeros(n, np.int64) if y is None else labels_int64(_np(y).reshape(-1), f"{where}: y")
    if y.shape[0] != n:
        raise DataError(f"{where}: 'y' has {y.shape[0]} entries, expected one per vertex ({n}); "
                        f"node classification labels only")
    masks = {}
    for m in MASKS:
        mask = getattr(data, f"{m}_mask", None)
        masks[m] = np.zeros(n, bool) if mask is None else _np(mask, bool).reshape(-1)
        if masks[m].shape[0] != n:
            raise DataError(f"{where}: '{m}_mask' has {masks[m].shape[0]} entries, expected {n}")
    return y, masks


def warn_repeated_edges(where: str, repeats: int) -> None:
    """The warning for edges a PyG graph repeats (hpcpar keeps each once)."""
    if repeats:
        warnings.warn(f"{where}: {repeats} repeated edge(s) merged: hpcpar graphs are simple "
                      f"graphs, while PyG's layers count a repeated edge once per copy "
                      f"(torch_geometric.utils.coalesce(edge_index) gives PyG the same graph)",
                      stacklevel=3)


def pyg_arrays(data: Any, where: str = "PyG Data") -> dict:
    """``{"num_nodes", "edge_index", "x", "y", "masks"}`` as numpy arrays of a PyG ``Data`` (or
    any object with its attributes; ``where`` names it in messages).

    ``edge_index`` ``(2, E)`` and ``x`` ``(N, F)`` are required; ``y`` ``(N,)`` (zeros when absent),
    boolean ``train_mask``/``val_mask``/``test_mask`` (all False when absent), ``num_nodes``
    (``x.shape[0]`` when absent). DataError: a missing ``edge_index``/``x`` or arrays of the wrong
    shapes."""
    n = pyg_num_nodes(data, where)
    x = _np(data.x, np.float32)
    edges = check_edges(_np(data.edge_index, np.int64), n, f"{where}: edge_index")
    warn_repeated_edges(where, edges.shape[1] - np.unique(edges[0] * n + edges[1]).shape[0])
    y, masks = pyg_vertex_fields(data, n, where)
    return {"num_nodes": n, "edge_index": edges, "x": x, "y": y, "masks": masks}


def _pyg_safe_globals() -> list:
    """The classes a ``torch.save(Data)`` file pickles (empty without PyG): only these may be
    rebuilt by the ``weights_only`` unpickler, so loading runs no code from the file."""
    try:
        from torch_geometric.data import Data, HeteroData
        from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
        from torch_geometric.data.storage import EdgeStorage, GlobalStorage, NodeStorage
    except ImportError:
        return []
    return [Data, HeteroData, DataEdgeAttr, DataTensorAttr, GlobalStorage, NodeStorage,
            EdgeStorage]


def _refusal(path, exc: Exception) -> DataError:
    """The one-line refusal of a pickle that needs globals beyond PyG's graph classes."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    allowed = {f"{c.__module__}.{c.__qualname__}" for c in _pyg_safe_globals()}
    try:
        names = [n for n in get_unsafe_globals_in_checkpoint(path) if n not in allowed]
    except Exception:  # noqa: BLE001 - a legacy (non-zip) file: name nothing
        names = []
    if any(n.startswith("torch_geometric.") for n in names) and not allowed:
        return DataError(f"{path}: needs torch_geometric to load safely (pip install "
                         f"torch_geometric, or 'hpcpar[gnn]')")
    what = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "") if names else \
        str(exc).strip().splitlines()[-1][:120]
    return DataError(f"{path}: refused to unpickle {what}: a .pt file can run code when "
                     f"loaded, and only PyG's graph classes are loaded by default; pass "
                     f"--trust-pickle if you trust this file")


def load_pyg(path: str | os.PathLike, trust_pickle: bool = False, mmap: bool = False) -> Any:
    """A PyG ``Data`` saved with ``torch.save`` (a saved dataset's first graph).

    The file is unpickled with ``weights_only=True`` and only PyG's graph classes allowed, so a file
    whose pickle would call anything else is refused, not run; ``trust_pickle`` unpickles anything
    (``weights_only=False``: may run the file's code). ``mmap`` maps the tensors from the file
    instead of reading them (zip-format files, torch.save's default since 1.6). DataError: a missing
    file, one that holds no graph, or one that needs classes beyond PyG's graph classes without
    ``trust_pickle``."""
    import torch

    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        if trust_pickle:
            obj = torch.load(path, weights_only=False, map_location="cpu", mmap=mmap)
        else:
            with torch.serialization.safe_globals(_pyg_safe_globals()):
                obj = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except ModuleNotFoundError as exc:
        raise DataError(f"{path}: needs the module {exc.name!r} to load (pip install "
                        f"torch_geometric, or 'hpcpar[gnn]')") from None
    except pickle.UnpicklingError as exc:
        if trust_pickle:
            raise DataError(f"{path}: not a torch.save file ({exc})") from None
        raise _refusal(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - any unreadable pickle: one line
        raise DataError(f"{path}: not a torch.save file ({type(exc).__name__}: "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") \
            from None
    if isinstance(obj, (tuple, list)) and obj and hasattr(obj[0], "edge_index"):
        obj = obj[0]
    if not hasattr(obj, "edge_index"):
        raise DataError(f"{path}: holds a {type(obj).__name__}, not a PyG Data (edge_index, "
                        f"x, ...)")
    return obj


def edge_list_chunks(path: str | os.PathLike, lines: int = 1 << 20) -> Iterator[np.ndarray]:
    """Read a text edge list in blocks of about ``lines`` lines, so a partitioner streams a
    file larger than memory: ``(2, k)`` int64 edges ``src -> dst`` per block, by the rules of
    :func:`read_edge_list`."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    pairs, header, seen, number = [], False, False, 0
    with open(path) as fh:
        for line in fh:
            number += 1
            words = line.split("#")[0].replace(",", " ").split()
            if not words:
                continue
            try:
                if len(words) < 2:
                    raise ValueError
                pairs.append((int(words[0]), int(words[1])))
                seen = True
            except ValueError:
                if not seen and not header:
                    header = True
                    continue     # a header line before the first edge
                raise DataError(f"{path}:{number}: expected 'src dst' (two integers), got "
                                f"{line.strip()!r}") from None
            if len(pairs) >= lines:
                yield np.asarray(pairs, np.int64).T.copy()
                pairs = []
    yield np.asarray(pairs, np.int64).reshape(-1, 2).T.copy()


def read_edge_list(path: str | os.PathLike) -> np.ndarray:
    """A text edge list: one ``src dst`` pair per line (spaces, tabs or commas; ``#`` comments and
    blank lines skipped; a non-numeric header line is skipped), as ``(2, E)`` int64 edges ``src ->
    dst``. DataError: a missing file or a line that is not two integers."""
    return np.concatenate(list(edge_list_chunks(path)), axis=1)


def _read_array(path: str | os.PathLike, what: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file ({what})")
    try:
        return np.load(path) if str(path).endswith(".npy") else np.loadtxt(path, ndmin=1,
                                                                           delimiter=None)
    except ValueError as exc:
        raise DataError(f"{path}: cannot read {what} ({exc})") from None


def random_masks(n: int, split: tuple[float, float], seed: int = 0) -> dict:
    """Disjoint random train/val/test masks of ``n`` vertices: fractions ``split = (train,
    val)`` (DataError unless >= 0 with sum <= 1), the rest test."""
    a, b = split
    if a < 0 or b < 0 or a + b > 1:
        raise DataError(f"--split {a},{b}: expected two fractions >= 0 summing to <= 1")
    order = np.random.default_rng(seed).permutation(n)
    cut = [round(a * n), round((a + b) * n)]
    masks = {m: np.zeros(n, bool) for m in MASKS}
    for m, part in zip(MASKS, np.split(order, cut)):
        masks[m][part] = True
    return masks


def import_graph(source: str | os.PathLike, out: str | os.PathLike,
                 features: str | os.PathLike | None = None,
                 labels: str | os.PathLike | None = None,
                 split: tuple[float, float] = (0.6, 0.2), seed: int = 0,
                 trust_pickle: bool = False) -> dict:
    """Convert a saved PyG ``Data`` (``.pt``/``.pth``) or an edge list (any other text file,
    with ``features``) to a graph file; returns a summary: vertices, edges, features, classes,
    direction and split sizes.

    Edge lists: ``features`` ``(N, F)`` and ``labels`` ``(N,)`` class ids (zeros when None),
    ``.npy`` or text (one row per vertex). Masks the source lacks (edge lists; a PyG Data without
    masks): random ``split = (train, val)`` fractions, the rest test. ``trust_pickle``: see
    :func:`load_pyg`. DataError: an unreadable source, missing features, or inconsistent shapes."""
    source = str(source)
    if source.endswith((".pt", ".pth")):
        arrays = pyg_arrays(load_pyg(source, trust_pickle), source)
        if not any(m.any() for m in arrays["masks"].values()):
            arrays["masks"] = random_masks(arrays["num_nodes"], split, seed)
    else:
        if features is None:
            raise DataError(f"{source}: an edge list needs --features (N x F, .npy or text)")
        x = _read_array(features, "features").astype(np.float32)
        x = x.reshape(-1, 1) if x.ndim == 1 else x
        n = x.shape[0]
        y = (np.zeros(n, np.int64) if labels is None
             else labels_int64(_read_array(labels, "labels").reshape(-1), f"{labels}"))
        if y.shape[0] != n:
            raise DataError(f"{labels}: {y.shape[0]} labels for {n} vertices (rows of "
                            f"{features})")
        edges = check_edges(read_edge_list(source), n, f"{source}")
        arrays = {"num_nodes": n, "edge_index": edges, "x": x, "y": y,
                  "masks": random_masks(n, split, seed)}
    n = arrays["num_nodes"]
    indptr, indices = edges_to_csr(arrays["edge_index"], n)
    directed = not is_symmetric(indptr, indices, n)
    y = arrays["y"]
    write_graph(out, n, arrays["x"], y, arrays["masks"], csr=(indptr, indices),
                directed=directed, name=os.path.splitext(os.path.basename(source))[0],
                source=source, num_classes=num_classes_of(y))
    return {"nodes": n, "edges": int(indices.shape[0]), "features": int(arrays["x"].shape[1]),
            "classes": num_classes_of(y), "directed": directed,
            **{m: int(arrays["masks"][m].sum()) for m in MASKS}}
