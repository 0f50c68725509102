"""Distributed graph convolutions over a :class:`hpcpar.graph.DistGraph`.

Called as ``conv(x, graph)`` with ``x`` the OWNED rows; they return owned rows. Parameters are
replicated; each rank's gradient is its partial sum, so the default gradient reduction
("spatial+data": SUM over the graph's ranks, ``data == 1``) yields the exact gradient under
:func:`hpcpar.graph.masked_loss` (the global loss; each rank's gradient is its own share's).
No tags are needed.

Both layers aggregate whichever side is narrower: when ``in > out`` they transform first and
exchange/aggregate ``out`` columns (A(XW) = (AX)W), else the other way round. ``agg=`` passes
a precomputed aggregate (e.g. the constant A·X of the first layer).

Any other PyG message-passing layer runs through :func:`distributed` (or
``graph.apply(conv, x)``): the halo rows are exchanged, the layer runs on this rank's local
view of the graph, and the owned rows are kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hpcpar.errors import LayerError

if TYPE_CHECKING:
    from hpcpar.graph.distgraph import DistGraph

__all__ = ["DistConv", "DistGCNConv", "DistSAGEConv", "distributed"]


class DistGCNConv(nn.Module):
    """``out = D~^-1/2 (A+I) D~^-1/2 X W + b`` (Kipf & Welling), global degrees.

    State-dict keys match PyG's ``GCNConv`` (``lin.weight``, ``bias``); Glorot weights, zero bias;
    the halo rows are exchanged inside."""

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weight, zero bias (PyG's initialisation)."""
        nn.init.xavier_uniform_(self.lin.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, graph: DistGraph,
                agg: torch.Tensor | None = None) -> torch.Tensor:
        """One GCN layer: the owned vertices' output features from their features ``x``, or
        from ``agg``, a precomputed ``A·x`` (the constant first-layer aggregate)."""
        if agg is not None:
            out = self.lin(agg)
        elif self.in_channels > self.out_channels:
            out = graph.propagate(self.lin(x), "gcn")
        else:
            out = self.lin(graph.propagate(x, "gcn"))
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, bias={self.bias is not None}"


class DistSAGEConv(nn.Module):
    """GraphSAGE: ``out = W_l · aggr_{j->i} x_j + b + W_r · x_i``; ``aggr="mean"`` divides the
    neighbour sum by the GLOBAL in-degree. Keys match PyG's ``SAGEConv`` (``lin_l``, ``lin_r``).
    ``aggr`` is ``"mean"`` or ``"sum"`` (else LayerError)."""

    def __init__(self, in_channels: int, out_channels: int, aggr: str = "mean",
                 bias: bool = True):
        super().__init__()
        if aggr not in ("mean", "sum"):
            raise LayerError(f"DistSAGEConv: aggr={aggr!r}, expected 'mean' or 'sum'")
        self.in_channels, self.out_channels, self.aggr = in_channels, out_channels, aggr
        self.lin_l = nn.Linear(in_channels, out_channels, bias=bias)
        self.lin_r = nn.Linear(in_channels, out_channels, bias=False)

    def forward(self, x: torch.Tensor, graph: DistGraph,
                agg: torch.Tensor | None = None) -> torch.Tensor:
        """One GraphSAGE layer: the owned vertices' output features from their features
        ``x`` (``agg``: a precomputed neighbour aggregate of ``x``)."""
        if agg is not None:
            neigh = self.lin_l(agg)
        elif self.in_channels > self.out_channels:
            neigh = graph.propagate(x @ self.lin_l.weight.t(), self.aggr)
            if self.lin_l.bias is not None:
                neigh = neigh + self.lin_l.bias
        else:
            neigh = self.lin_l(graph.propagate(x, self.aggr))
        return neigh + self.lin_r(x)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr={self.aggr!r}"


class DistConv(nn.Module):
    """A PyG message-passing layer on a distributed graph: ``DistConv(conv)(x, graph)`` is
    ``graph.apply(conv, x)`` (see [DistGraph.apply][hpcpar.graph.distgraph.DistGraph.apply]).

    The wrapped layer is ``self.conv`` (state-dict keys ``conv.*``); its parameters are replicated,
    and their gradients are SUMMED over the graph's ranks by the default gradient sync. ``conv`` is
    called as ``conv(x, edge_index, ...)``, or with the graph's sparse ``adj_t`` in place of its
    local ``edge_index`` when ``sparse``."""

    def __init__(self, conv: nn.Module, sparse: bool = False):
        super().__init__()
        self.conv, self.sparse = conv, sparse

    def forward(self, x: torch.Tensor, graph: DistGraph, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        return graph.apply(self.conv, x, *args, sparse=self.sparse, **kwargs)

    def extra_repr(self) -> str:
        return f"sparse={self.sparse}"


def distributed(conv: nn.Module, sparse: bool = False) -> DistConv:
    """Wrap a PyG message-passing layer (``GATConv``, ``GINConv``, your own ...) so that it
    runs on a :class:`~hpcpar.graph.DistGraph` with its full-graph result: a
    :class:`DistConv`, called as ``layer(x_owned, graph)``.

    Example:
        ```python
        from torch_geometric.nn import GATConv
        layer = distributed(GATConv(graph.num_features, 8, heads=8))
        out = layer(graph.x, graph)          # rows of this rank's owned vertices
        ```
    """
    return DistConv(conv, sparse)
