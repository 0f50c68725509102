"""GCN / GraphSAGE node classifier for full-graph training on a DistGraph.

``GCN(in, hidden, out, num_layers=2, dropout=0.5)`` is Kipf & Welling's model: dropout on the
input of every layer, ReLU between layers. ``model(x, graph)`` returns logits of the owned
vertices. Dropout masks come from a hash of (seed, forward call, layer, GLOBAL vertex id,
column) (:mod:`hpcpar.graph.dropout`), so a seed gives the same training at every rank count.

``precompute=True`` computes the constant ``A·X`` of the first layer once (no halo exchange of
the widest tensor per epoch). Input dropout then acts on ``A·X`` instead of ``X`` (a slightly
different model); for the GCN first layer with ``dropout=0`` it is exact.

``boundary_sample=p < 1`` trains with BNS-GCN boundary sampling: each training forward sees
the graph through :meth:`~hpcpar.graph.DistGraph.boundary_sample` (a fresh seeded sample of
the halo per call, shared by all layers of that call); evaluation stays exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import LayerError
from ..graph.dropout import vertex_dropout
from ..nn.graph import DistGCNConv, DistSAGEConv

if TYPE_CHECKING:
    from hpcpar.graph.distgraph import DistGraph

__all__ = ["GCN"]


class GCN(nn.Module):
    """GCN or GraphSAGE node classifier: ``model(x, graph)`` returns logits of the owned vertices
    (``out_channels`` classes). ``conv`` is ``"gcn"`` (``DistGCNConv``) or ``"sage"``
    (``DistSAGEConv``, aggregating by ``aggr``: ``"mean"`` or ``"sum"``); ``dropout``, ``seed``,
    ``precompute`` and ``boundary_sample`` (the fraction of boundary rows each rank sends per
    training step) as in the module docstring. LayerError: an unknown ``conv``, or
    ``boundary_sample`` outside ``(0, 1]``."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int,
                 num_layers: int = 2, dropout: float = 0.5, conv: str = "gcn",
                 precompute: bool = False, seed: int = 0, aggr: str = "mean",
                 boundary_sample: float = 1.0):
        super().__init__()
        if conv not in ("gcn", "sage"):
            raise LayerError(f"GCN: conv={conv!r}, expected 'gcn' or 'sage'")
        if not 0.0 < boundary_sample <= 1.0:
            raise LayerError(f"GCN: boundary_sample={boundary_sample}, expected a fraction "
                             "0 < p <= 1 (1 = exact)")
        self.boundary_sample = float(boundary_sample)
        widths = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        make = (lambda i, o: DistGCNConv(i, o)) if conv == "gcn" else \
            (lambda i, o: DistSAGEConv(i, o, aggr=aggr))
        self.convs = nn.ModuleList(make(i, o) for i, o in zip(widths[:-1], widths[1:]))
        self.dropout, self.conv, self.precompute, self.seed = dropout, conv, precompute, seed
        self.aggr = aggr
        self.calls = 0  # training forward passes so far (drives the dropout masks)
        self._agg: tuple[tuple, torch.Tensor] | None = None

    def first_aggregate(self, x: torch.Tensor, graph: DistGraph) -> torch.Tensor:
        """The first layer's constant ``A·X`` on the owned vertices, cached per graph and input."""
        key = (id(graph), x.data_ptr(), tuple(x.shape))
        if self._agg is None or self._agg[0] != key:
            with torch.no_grad():
                agg = graph.propagate(x, "gcn" if self.conv == "gcn" else self.aggr)
            self._agg = (key, agg)
        return self._agg[1]

    def forward(self, x: torch.Tensor, graph: DistGraph) -> torch.Tensor:
        """Features of the owned vertices -> logits of the owned vertices."""
        call = self.calls
        full = graph  # the constant first aggregate is exact and cached on the full graph
        if self.training:
            self.calls += 1
            if self.boundary_sample < 1.0:
                graph = graph.boundary_sample(self.boundary_sample, self.seed, call)

        def drop(t, stream):
            return vertex_dropout(t, self.dropout, graph.source_ids, self.seed, call, stream,
                                  self.training)

        for layer, conv in enumerate(self.convs):
            if layer:
                x = conv(drop(torch.relu(x), layer), graph)
            elif self.precompute:
                agg = drop(self.first_aggregate(x, full), len(self.convs))
                x = conv(drop(x, 0) if self.conv == "sage" else None, graph, agg=agg)
            else:
                x = conv(drop(x, 0), graph)
        return x

    def get_extra_state(self) -> dict:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict) -> None:
        self.calls = int(state.get("calls", 0))
