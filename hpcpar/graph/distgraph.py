"""A graph partitioned over the ranks of a communicator, for exact full-graph GNN training.

Each rank holds only its owned vertices: their in-edge rows (sources as global ids), features,
labels and masks. Local order: owned vertices (ascending global id) then halo vertices grouped
by owner (see :mod:`hpcpar.graph._vertex_halo`). Aggregation operators are local sparse matrices
``(n_owned, n_owned + n_halo)`` whose weights use GLOBAL degrees:

* ``"gcn"``: ``D~^-1/2 (A + I) D~^-1/2`` — a self loop is added only where none exists (never
  doubled), ``D~`` is the in-degree of ``A + I`` and a zero degree gives a zero weight;
* ``"mean"``: ``A`` divided by the global in-degree (0 for isolated vertices); ``"sum"``: ``A``.

Every row's entries are ordered by global source id, so a row's sum runs in the same order whatever
the partition. The backward product uses the stored transpose (exact for directed graphs).

A graph is one sample: build it over a grid with ``data == 1``; it is split over
``grid.spatial_comm``."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hpcpar.graph._csr import edges_to_csr, is_symmetric, sorted_unique
from hpcpar.graph._csr import row_positions as _row_positions
from hpcpar.graph._sparse import SparseOperator
from hpcpar.graph._vertex_halo import HaloPlan, SampledHaloPlan, aggregate, with_halo
from hpcpar.graph.agreement import check_agree, digest
from hpcpar.graph.interop import pyg_arrays
from hpcpar.graph.shards import RangeOwner, read_graph_manifest, read_part
from hpcpar.graph.vertex_partition import partition_csr
from hpcpar.parallel.agree import agree
from hpcpar.parallel.comm import allgatherv, allreduce_, alltoallv
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.partition import part_range

from ..errors import DataError, LayerError
from .format import MASKS, GraphFile

__all__ = ["DistGraph", "graph_comm", "normalize_rows"]

KINDS = ("gcn", "mean", "sum")


def graph_comm(grid: Any) -> Any:
    """The communicator a graph is split over: ``grid.spatial_comm`` of a ``ProcessGrid``, or
    ``grid`` itself (an MPI communicator). A graph is one sample: DataError for a process grid
    with more than one data group."""
    if hasattr(grid, "spatial_comm"):
        if grid.data != 1:
            raise DataError(f"DistGraph: grid {grid.spec() if hasattr(grid, 'spec') else ''}"
                            f" has data={grid.data}; a graph is one sample, so full-graph "
                            "training needs data=1 (split the graph over x, e.g. --grid "
                            f"1x{grid.size}x1x1)")
        return grid.spatial_comm
    return grid


def normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """Each feature row divided by its L1 norm (rows of zeros kept): Kipf & Welling's row
    normalisation. The L1 norm, not the plain sum: the same for non-negative features
    (bag-of-words), while a signed row's sum can be ~0 and blow the row up."""
    s = x.abs().sum(1, keepdim=True)
    return torch.where(s != 0, x / torch.where(s != 0, s, 1), x)


class DistGraph:
    """This rank's part of a graph: its owned vertices, their rows, features, labels and masks,
    and the halo plan that brings the boundary neighbours' rows in every layer.

    Build it with [from_hdf5][hpcpar.graph.distgraph.DistGraph.from_hdf5],
    [from_pyg][hpcpar.graph.distgraph.DistGraph.from_pyg] or
    [from_global][hpcpar.graph.distgraph.DistGraph.from_global]; the constructor takes the
    rows of this rank's contiguous block and moves them to their owners (collective).

    ``num_nodes`` counts the whole graph; ``num_owned`` vertices are this rank's (local rows ``[0,
    num_owned)``, global ids ``global_ids``, ascending), ``num_halo`` the halo vertices after them,
    grouped by owner (``halo_ids``). ``x`` ``(num_owned, F)``, ``y`` and ``in_degree`` (global) are
    the owned vertices'. ``num_train``/``num_val``/``num_test`` count the whole graph (the loss
    divides by ``num_train``)."""

    #: Source-graph ids of the owned vertices (from_shards: the format renumbers them; or
    #: from_global's ``original_ids``)
    original_ids: np.ndarray | None = None
    #: The halo plan (a step's boundary sample in a view from ``boundary_sample``)
    plan: HaloPlan | SampledHaloPlan
    # received in _receive_rows (declared here: __init__ reads them first)
    x: torch.Tensor
    y: torch.Tensor
    masks: dict[str, torch.Tensor]

    def __init__(self, comm, num_nodes: int, owner: Any, block: dict, start: int,
                 num_classes: int | None = None, directed: bool | None = None,
                 row_normalize: bool = False, backend: str = "auto"):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.num_nodes = int(num_nodes)
        self.backend = backend
        self.directed = directed
        self._receive_rows(owner, block, start)
        self._build_halo(owner)
        counts = torch.tensor([int(m.sum()) for m in self.masks.values()], dtype=torch.int64)
        allreduce_(counts, comm)
        self.num_train, self.num_val, self.num_test = (int(c) for c in counts)
        if num_classes is None:
            num_classes = comm.allreduce(int(self.y.max()) + 1 if self.y.numel() else 0,
                                         op=_max())
        self.num_classes = int(num_classes)
        if row_normalize:
            self.x = normalize_rows(self.x)
        self._ops: dict = {}
        self._views: dict = {}  # local edge_index / adj_t, built on first use

    # ---- construction -------------------------------------------------------------------
    def _receive_rows(self, owner: np.ndarray, block: dict, start: int) -> None:
        """Send each row of this rank's contiguous block to its owner (Alltoallv)."""
        ip = block["indptr"]
        n_blk = ip.shape[0] - 1
        dest = owner[start:start + n_blk]
        order = np.argsort(dest, kind="stable")
        rows = np.bincount(dest, minlength=self.size).tolist()
        deg = np.diff(ip)
        mine = np.stack([np.arange(start, start + n_blk, dtype=np.int64), deg, block["y"],
                         *(block[m].astype(np.int64) for m in MASKS)], axis=1)[order]
        received = alltoallv(torch.from_numpy(np.ascontiguousarray(mine)), rows, self.comm)
        self.x = alltoallv(torch.from_numpy(np.ascontiguousarray(block["x"][order],
                                                                  np.float32)),
                           rows, self.comm)
        edge_rows = np.bincount(dest, weights=deg, minlength=self.size).astype(np.int64)
        src = block["indices"][_row_positions(ip, order)]
        self.src_ids = alltoallv(torch.from_numpy(np.ascontiguousarray(src, np.int64)),
                                 edge_rows.tolist(), self.comm).numpy()
        meta = received.numpy()
        self.global_ids = meta[:, 0].copy()
        self.in_degree = meta[:, 1].copy()
        self.y = torch.from_numpy(meta[:, 2].copy())
        self.masks = {
            m: torch.from_numpy(meta[:, 3 + k].astype(bool)) for k, m in enumerate(MASKS)}
        self.num_owned = self.global_ids.shape[0]
        self.indptr = np.zeros(self.num_owned + 1, np.int64)
        np.cumsum(self.in_degree, out=self.indptr[1:])

    def _build_halo(self, owner: np.ndarray) -> None:
        src_owner = owner[self.src_ids]
        halo_sorted = sorted_unique(self.src_ids[src_owner != self.rank])
        by_owner = np.argsort(owner[halo_sorted], kind="stable")
        self.halo_ids = halo_sorted[by_owner]
        self.num_halo = self.halo_ids.shape[0]
        self.plan = HaloPlan.build(self.comm, self.global_ids, self.halo_ids,
                                   owner[self.halo_ids])
        position = np.empty_like(by_owner)
        position[by_owner] = np.arange(by_owner.shape[0])
        own = src_owner == self.rank
        cols = np.empty_like(self.src_ids)
        cols[own] = np.searchsorted(self.global_ids, self.src_ids[own])
        cols[~own] = self.num_owned + position[np.searchsorted(halo_sorted,
                                                               self.src_ids[~own])]
        self.cols = cols  # local column of every in-edge

    # ---- properties -----------------------------------------------------------------------
    @property
    def train_mask(self) -> torch.Tensor:
        """Which owned vertices are training vertices."""
        return self.masks["train"]

    @property
    def val_mask(self) -> torch.Tensor:
        """Which owned vertices are validation vertices."""
        return self.masks["val"]

    @property
    def test_mask(self) -> torch.Tensor:
        """Which owned vertices are test vertices."""
        return self.masks["test"]

    @property
    def num_features(self) -> int:
        """Features per vertex."""
        return int(self.x.shape[1])

    def mask(self, name: str) -> torch.Tensor:
        """The owned-vertex mask ``"train"``, ``"val"`` or ``"test"``."""
        return self.masks[name]

    def num_masked(self, name: str) -> int:
        """GLOBAL number of vertices in mask ``"train"``, ``"val"`` or ``"test"``."""
        return {"train": self.num_train, "val": self.num_val, "test": self.num_test}[name]

    # ---- operators ------------------------------------------------------------------------
    def operator(self, kind: str = "gcn") -> SparseOperator:
        """The local aggregation matrix of ``kind`` (module docstring; DataError for another),
        over owned rows and owned + halo columns, built once."""
        if kind not in KINDS:
            raise DataError(f"aggregation {kind!r}: expected one of {', '.join(KINDS)}")
        if kind not in self._ops:
            self._ops[kind] = self._build_operator(kind).to(self.x.device)
        return self._ops[kind]

    def _build_operator(self, kind: str) -> SparseOperator:
        # weights in float64; the operator casts them once per compute dtype
        n, rows = self.num_owned, np.repeat(np.arange(self.num_owned), self.in_degree)
        width = n + self.num_halo
        if kind == "sum":
            return SparseOperator(self.indptr, self.cols, np.ones(self.cols.shape[0]), width,
                                  self.backend)
        if kind == "mean":
            inv = np.where(self.in_degree > 0, 1.0 / np.maximum(self.in_degree, 1), 0.0)
            return SparseOperator(self.indptr, self.cols, inv[rows], width, self.backend)
        has_loop = np.zeros(n, bool)
        has_loop[rows[self.src_ids == self.global_ids[rows]]] = True
        deg = (self.in_degree + ~has_loop).astype(np.float64)
        # the degrees travel on the plan's device (its indices follow the graph to a GPU)
        halo_deg = self.plan.exact.fetch(torch.from_numpy(deg).to(self.x.device)).cpu() \
            .numpy() if self.plan.distributed else np.zeros(0)
        full = np.concatenate([deg, halo_deg])
        dinv = np.where(full > 0, 1.0 / np.sqrt(np.maximum(full, 1e-300)), 0.0)
        loops = np.flatnonzero(~has_loop)
        r = np.concatenate([rows, loops])
        c = np.concatenate([self.cols, loops])
        g = np.concatenate([self.src_ids, self.global_ids[loops]])
        order = np.lexsort((g, r))  # by row, then by GLOBAL source id
        r, c = r[order], c[order]
        indptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(r, minlength=n), out=indptr[1:])
        return SparseOperator(indptr, c, dinv[r] * dinv[c], width, self.backend)

    def propagate(self, x: torch.Tensor, kind: str = "gcn") -> torch.Tensor:
        """Aggregate over in-neighbours: ``A_kind @ x``, ``(num_owned, F)`` in and out (``kind``
        as in [operator][hpcpar.graph.distgraph.DistGraph.operator]). The halo rows are exchanged
        first (autograd-aware: backward adds the halo gradients into their owners)."""
        return aggregate(x, self.plan, self.operator(kind))

    def boundary_sample(self, p: float, seed: int, call: int) -> DistGraph:
        """This graph as one training step sees it under BNS-GCN boundary sampling.

        Each rank sends only a fraction ``p`` of the boundary rows each neighbour rank needs
        (a fresh seeded sample per ``call``, the same on sender and receiver, so no extra
        message); the receiver scales them by ``n / k`` (the inverse of the sampled fraction,
        as BNS-GCN) and the edges to unsampled halo vertices drop out for the step. Degrees
        and normalisation stay the full graph's. The backward is the exact adjoint of this
        sampled operator. Only linear aggregations (:meth:`propagate`) are unbiased under
        it; evaluate on the graph itself (exact).

        Returns a view sharing everything with this graph but the halo plan (this graph itself for
        ``p == 1``); LayerError for ``p`` outside ``(0, 1]``."""
        if not 0.0 < p <= 1.0:
            raise LayerError(f"boundary_sample: p = {p}, expected a fraction 0 < p <= 1 "
                             "(1 = exact)")
        if p == 1.0 or not self.plan.distributed:
            return self
        view = copy.copy(self)
        view.plan = SampledHaloPlan(self.plan.exact, p, seed, call)
        return view

    @property
    def source_ids(self) -> np.ndarray:
        """Ids of the owned vertices that do not depend on the numbering: the source graph's
        (``original_ids``) where the format renumbered them, else ``global_ids``. Dropout
        masks hash these, so a sharded graph drops what the source graph drops."""
        return self.global_ids if self.original_ids is None else self.original_ids

    # ---- local view: any PyG message-passing layer -----------------------------------------
    @property
    def num_local(self) -> int:
        """Owned + halo vertices: the rows of :meth:`exchange`'s result."""
        return self.num_owned + self.num_halo

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows followed by its halo rows, ``[x_owned; x_halo]`` (collective).

        Backward is the exact adjoint: each halo row's gradient is sent back to its owner and added
        to the owned row's gradient. Identity on one rank. ``(num_owned, ...)`` in (else
        LayerError), ``(num_local, ...)`` out, in the local numbering of
        [local_edge_index][hpcpar.graph.distgraph.DistGraph.local_edge_index]."""
        if x.dim() == 0 or x.shape[0] != self.num_owned:
            raise LayerError(f"DistGraph.exchange: x has shape {tuple(x.shape)}, expected "
                             f"one row per owned vertex ({self.num_owned}, ...) on rank "
                             f"{self.rank}")
        return with_halo(x, self.plan)

    def local_edge_index(self) -> torch.Tensor:
        """Every in-edge of the owned vertices as a PyG ``edge_index`` in local numbering.

        ``[0]``: sources, local ids ``[0, num_local)`` (owned, then halo: the rows of
        :meth:`exchange`); ``[1]``: destinations, owned ids ``[0, num_owned)``. Sorted by
        destination, then by global source id; duplicate edges were dropped at the build. Since
        every in-edge of an owned vertex is here, a message-passing layer's outputs on the owned
        rows are its full-graph outputs (per-destination softmax included)."""
        if "edge_index" not in self._views:
            dst = np.repeat(np.arange(self.num_owned, dtype=np.int64), self.in_degree)
            self._views["edge_index"] = torch.from_numpy(
                np.stack([self.cols, dst])).to(self.x.device)
        return self._views["edge_index"]

    def adj_t(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`local_edge_index` as a square ``torch.sparse_csr`` ``adj_t`` (PyG's
        transposed adjacency: row = destination, column = source), ``(num_local, num_local)``
        with empty halo rows, values 1 in ``dtype`` (default: the features' dtype; pass the
        input's for PyG's SpMM path). Cached per dtype."""
        dtype = self.x.dtype if dtype is None else dtype
        if ("adj_t", dtype) not in self._views:
            crow = np.concatenate([self.indptr, np.full(self.num_halo, self.indptr[-1])])
            with warnings.catch_warnings():  # "sparse CSR support is in beta"
                warnings.simplefilter("ignore", UserWarning)
                self._views["adj_t", dtype] = torch.sparse_csr_tensor(
                    torch.from_numpy(crow), torch.from_numpy(self.cols),
                    torch.ones(self.cols.shape[0], dtype=dtype),
                    (self.num_local, self.num_local)).to(self.x.device)
        return self._views["adj_t", dtype]

    def apply(self, conv: Callable[..., Any], x: torch.Tensor, *args: Any,
              sparse: bool = False, **kwargs: Any) -> torch.Tensor:
        """Run a PyG message-passing layer (or any ``conv(x, edge_index, ...)``) on the
        distributed graph: ``conv(self.exchange(x), self.local_edge_index(), ...)[:num_owned]``.

        Exact for layers whose output at a vertex depends only on its own row and its in-neighbours'
        rows (``GATConv``, ``GINConv``, ``GraphConv``, ``TransformerConv``, ``SAGEConv``, a custom
        ``MessagePassing``); not for layers that need the degrees of source vertices (``GCNConv``'s
        normalisation: use ``hpcpar.nn.graph.DistGCNConv``). Parameters are replicated: SUM their
        gradients over the graph's ranks (the default gradient sync). ``sparse`` passes
        :meth:`adj_t` instead of :meth:`local_edge_index`."""
        edges = self.adj_t(x.dtype) if sparse else self.local_edge_index()
        return conv(self.exchange(x), edges, *args, **kwargs)[:self.num_owned]

    # ---- utilities --------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> DistGraph:
        """Move features, labels, masks, the halo plan and cached operators to ``device``."""
        self.x = self.x.to(device)
        self.y = self.y.to(device)
        self.masks = {k: v.to(device) for k, v in self.masks.items()}
        self.plan.to(device)
        for op in self._ops.values():
            op.to(device)
        self._views = {k: v.to(device) for k, v in self._views.items()}
        return self

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Rows ``t``, one per owned vertex, assembled from every rank in global vertex order:
        ``(num_nodes, ...)`` on every rank (collective; for tests and small graphs)."""
        rows = allgatherv(t.detach().contiguous(), self.comm)
        ids = allgatherv(torch.from_numpy(self.global_ids), self.comm)
        out = torch.empty_like(rows)
        out[ids.to(rows.device)] = rows
        return out

    def halo_bytes(self, features: int, itemsize: int = 4) -> int:
        """Bytes ALL ranks send in one forward exchange of ``features`` columns."""
        return int(self.comm.allreduce(self.plan.bytes_per_exchange(features, itemsize)))

    # ---- builders ---------------------------------------------------------------------------
    @classmethod
    def from_global(cls, edge_index: torch.Tensor | np.ndarray, num_nodes: int,
                    x: torch.Tensor | np.ndarray, grid: ProcessGrid,
                    y: torch.Tensor | np.ndarray | None = None, masks: dict | None = None,
                    method: str = "metis", seed: int = 0, owner: np.ndarray | None = None,
                    original_ids: np.ndarray | None = None, **kw: Any) -> DistGraph:
        """Partition a graph that every rank holds in full (small graphs, tests); this rank's part.

        ``edge_index`` ``(2, E)``: edges ``src -> dst``; ``x`` ``(N, F)``; ``y`` ``(N,)`` labels
        (zeros when None); ``masks`` ``{"train": ..., "val": ..., "test": ...}``, boolean ``(N,)``.
        The graph is split over ``grid``'s spatial ranks (``data == 1``). ``method``: ``"metis"``,
        ``"block"`` or ``"random"``, or a ready ``owner`` rank per vertex. ``original_ids``
        ``(N,)``: each vertex's id in the source graph, where the caller renumbered it (dropout
        masks hash these, as a sharded graph's). ``kw`` goes to the constructor (``num_classes``,
        ``directed``, ``row_normalize``, ``backend``). DataError: more ranks than vertices, a grid
        with ``data > 1``, or ``original_ids`` not ``(N,)``."""
        comm = graph_comm(grid)
        if original_ids is not None and np.shape(original_ids) != (num_nodes,):
            raise DataError(f"DistGraph: original_ids has shape {np.shape(original_ids)}, "
                            f"expected ({num_nodes},)")
        indptr, indices = agree(comm, edges_to_csr, edge_index, num_nodes)
        x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
        y = np.zeros(num_nodes, np.int64) if y is None else np.asarray(
            y.cpu() if hasattr(y, "cpu") else y, np.int64)
        masks = masks or {}
        masks = {m: np.asarray(masks[m].cpu() if hasattr(masks.get(m), "cpu") else masks[m],
                               bool) if m in masks else np.zeros(num_nodes, bool)
                 for m in MASKS}
        check_agree(comm, "DistGraph", {
            "vertices": int(num_nodes), "edges": int(np.shape(edge_index)[1]),
            "feature width": tuple(x.shape[1:]),
            "structure checksum": digest(indptr, indices),
            "features/labels/masks checksum": digest(x, y, *masks.values())})
        kw.setdefault("directed", not is_symmetric(indptr, indices, num_nodes))
        if owner is None:
            owner = _owner(comm, lambda: (indptr, indices), num_nodes, method, seed,
                           symmetric=not kw["directed"])
        start, stop = part_range(num_nodes, comm.Get_size(), comm.Get_rank())
        block = {"indptr": indptr[start:stop + 1] - indptr[start],
                 "indices": indices[indptr[start]:indptr[stop]], "x": x[start:stop],
                 "y": y[start:stop], **{m: masks[m][start:stop] for m in MASKS}}
        g = cls(comm, num_nodes, np.asarray(owner, np.int64), block, start, **kw)
        if original_ids is not None:
            g.original_ids = np.asarray(original_ids, np.int64)[g.global_ids]
        return g

    @classmethod
    def from_pyg(cls, data: Any, grid: ProcessGrid, method: str = "metis", seed: int = 0,
                 **kw: Any) -> DistGraph:
        """Partition a PyTorch Geometric ``Data`` that every rank holds in full.

        Reads ``edge_index`` (``[0]`` source, ``[1]`` target, as PyG), ``x``, and when present
        ``y``, ``train_mask``/``val_mask``/``test_mask`` and ``num_nodes``. Layers then aggregate
        over in-edges like PyG's ``flow="source_to_target"``. ``data`` may be any object with those
        attributes; the rest as in [from_global][hpcpar.graph.distgraph.DistGraph.from_global].
        DataError: missing ``edge_index``/``x``, arrays of the wrong shapes, more ranks than
        vertices, or a grid with ``data > 1``.

        Example:
            ```python
            from torch_geometric.datasets import Planetoid
            graph = DistGraph.from_pyg(Planetoid(root, "Cora")[0], grid)
            ```
        """
        a = agree(graph_comm(grid), pyg_arrays, data)
        return cls.from_global(a["edge_index"], a["num_nodes"], a["x"], grid, y=a["y"],
                               masks=a["masks"], method=method, seed=seed, **kw)

    @classmethod
    def from_hdf5(cls, path: str | os.PathLike, grid: ProcessGrid, method: str = "metis",
                  seed: int = 0, **kw: Any) -> DistGraph:
        """Read and partition a graph file (format: ``docs/guides/gnn.md``).

        Each rank reads one contiguous block of rows (hyperslabs), then rows move to their owners.
        METIS partitions on rank 0 (which reads the structure) and broadcasts. Arguments as in
        [from_global][hpcpar.graph.distgraph.DistGraph.from_global]. DataError: more ranks than
        vertices, a grid with ``data > 1``, or not a valid graph file."""
        comm = graph_comm(grid)
        gf = agree(comm, GraphFile, path)
        try:
            n = gf.num_nodes
            check_agree(comm, "DistGraph.from_hdf5", {
                "vertices": n, "edges": int(gf.f.attrs.get("num_edges", -1)),
                "feature width": gf.num_features, "classes": gf.num_classes,
                "directed": gf.directed})
            owner = _owner(comm, gf.read_structure, n, method, seed,
                           symmetric=not gf.directed)
            start, stop = part_range(n, comm.Get_size(), comm.Get_rank())
            block = agree(comm, gf.read_rows, start, stop)
            kw.setdefault("num_classes", gf.num_classes)
            kw.setdefault("directed", gf.directed)
        finally:
            gf.close()
        return cls(comm, n, owner, block, start, **kw)

    @classmethod
    def from_shards(cls, path: str | os.PathLike, grid: ProcessGrid, **kw: Any) -> DistGraph:
        """Build from a sharded graph (``hpcpar data graph partition``): rank ``r`` reads
        part ``r`` only, and finds its halo from its own rows.

        Vertices carry the format's renumbered ids (part ``p`` owns the range ``[offsets[p],
        offsets[p+1])``), so the owner of an id is a binary search over the ``P + 1`` offsets: no
        rank holds anything N-long. ``original_ids`` maps the owned rows back to the source graph's
        ids. Bit-identical to [from_global][hpcpar.graph.distgraph.DistGraph.from_global] on the
        renumbered graph with the same owners. ``grid``'s spatial ranks must equal the parts.
        DataError: a missing or damaged manifest or part file, a part count other than the ranks, or
        a grid with ``data > 1``."""
        comm = graph_comm(grid)
        m = agree(comm, read_graph_manifest, path)
        if m["parts"] != comm.Get_size():
            exc = DataError(f"{path}: partitioned into {m['parts']} parts, but the graph is "
                            f"split over {comm.Get_size()} ranks (run on {m['parts']} ranks, "
                            f"or partition again with --parts {comm.Get_size()})")
            exc.collective = True
            raise exc
        check_agree(comm, "DistGraph.from_shards", {
            k: m[k] for k in ("num_nodes", "num_edges", "num_features", "num_classes",
                              "directed")} | {"offsets": tuple(m["offsets"])})
        rank = comm.Get_rank()
        block = agree(comm, read_part, path, m, rank)
        kw.setdefault("num_classes", m["num_classes"])
        kw.setdefault("directed", m["directed"])
        g = cls(comm, m["num_nodes"], RangeOwner(m["offsets"]), block, m["offsets"][rank],
                **kw)
        g.original_ids = block["original_ids"]
        return g


def _owner(comm, structure, num_nodes: int, method: str, seed: int,
           symmetric: bool = False) -> np.ndarray:
    """Owner array on every rank: computed on rank 0 (METIS needs the whole graph), broadcast.

    Only METIS on more than one rank reads the whole structure: it is the one step where a rank
    holds more than its own rows (``symmetric`` lets METIS take it without a copy)."""
    size = comm.Get_size()

    def compute():
        if comm.Get_rank() != 0:
            if size > num_nodes:  # same check as rank 0, so all ranks fail alike
                raise DataError(f"partition: {size} parts for a graph of {num_nodes} "
                                "vertices (need at least one vertex per part)")
            return None
        indptr, indices = structure() if method == "metis" and size > 1 else (
            np.zeros(num_nodes + 1, np.int64), np.zeros(0, np.int64))
        return partition_csr(indptr, indices, size, method, seed, symmetric=symmetric)

    owner = agree(comm, compute)
    buf = owner if owner is not None else np.empty(num_nodes, np.int64)
    comm.Bcast(buf, root=0)
    return buf


def _max():
    from mpi4py import MPI

    return MPI.MAX
