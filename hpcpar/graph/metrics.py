"""Loss and metrics of a partitioned graph, computed on owned vertices only.

Loss: the global mean over a split on every rank, as a volume model's loss is. Each rank's share
(the SUM over its owned vertices of the split, divided by the GLOBAL size of the split) is
SUM-allreduced in forward, and backward is the identity, so each rank's gradient is its own share's
and SUMMING gradients over the graph's ranks (the default ``"spatial+data"`` reduction with ``data
== 1``) gives exactly the single-process gradient. Accuracy: correct and total counts are
SUM-allreduced, so every rank returns the global value."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hpcpar.parallel.comm import allreduce_
from hpcpar.parallel.primitives import ReplicatedSum

if TYPE_CHECKING:
    from hpcpar.graph.distgraph import DistGraph

__all__ = ["masked_loss", "split_metrics"]


def masked_loss(logits: torch.Tensor, graph: DistGraph, split: str = "train") -> torch.Tensor:
    """Mean cross entropy over a split of the whole graph, the same on every rank (collective).

    The value is the single-process loss; the gradient on each rank is that of its own share (its
    owned vertices' sum / the GLOBAL count), so summing gradients over the graph's ranks gives
    exactly the single-process gradient. Do not allreduce the value again. ``logits``: the owned
    vertices'; ``split``: ``"train"``, ``"val"`` or ``"test"``."""
    m = graph.mask(split)
    total = max(graph.num_masked(split), 1)
    share = F.cross_entropy(logits[m], graph.y[m], reduction="sum") / total
    if graph.comm.Get_size() == 1:
        return share
    # the shares add in float64, as the volume side's global reductions do
    return ReplicatedSum.apply(share.double(), graph.comm).to(share.dtype)


def split_metrics(logits: torch.Tensor, graph: DistGraph, split: str) -> dict:
    """Accuracy and mean loss of a split over the whole graph (collective), as in
    :func:`masked_loss`: ``{f"{split}_acc": ..., f"{split}_loss": ...}``, the same on every rank."""
    m = graph.mask(split)
    with torch.no_grad():
        correct = (logits[m].argmax(1) == graph.y[m]).sum().double()
        loss = F.cross_entropy(logits[m].double(), graph.y[m], reduction="sum")
        acc = torch.stack([correct, loss, m.sum().double()]).cpu()
    allreduce_(acc, graph.comm)
    n = max(float(acc[2]), 1.0)
    return {f"{split}_acc": float(acc[0]) / n, f"{split}_loss": float(acc[1]) / n}
