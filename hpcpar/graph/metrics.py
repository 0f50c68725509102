"""Loss and metrics of a partitioned graph, computed on owned vertices only.

Loss: the SUM of the per-vertex loss over this rank's owned vertices of a split divided by the
GLOBAL size of the split, so that SUMMING gradients over the graph's ranks (the default
``"spatial+data"`` reduction with ``data == 1``) gives exactly the single-process gradient of
the mean loss. Accuracy: correct and total counts are SUM-allreduced, so every rank returns
the global value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hpcpar.parallel.comm import allreduce_

if TYPE_CHECKING:
    from hpcpar.graph.distgraph import DistGraph

__all__ = ["masked_loss", "split_metrics"]


def masked_loss(logits: torch.Tensor, graph: DistGraph, split: str = "train") -> torch.Tensor:
    """Cross entropy summed over the owned vertices of a split, divided by the GLOBAL count.

    Summing the gradients of this loss over the graph's ranks gives exactly the
    single-process gradient of the mean loss.

    Args:
        logits: Logits of the owned vertices.
        graph: This rank's part of the graph.
        split: ``"train"``, ``"val"`` or ``"test"``.

    Returns:
        A scalar: this rank's share of the mean loss.
    """
    m = graph.mask(split)
    total = max(graph.num_masked(split), 1)
    return F.cross_entropy(logits[m], graph.y[m], reduction="sum") / total


def split_metrics(logits: torch.Tensor, graph: DistGraph, split: str) -> dict:
    """Accuracy and mean loss of a split over the whole graph (collective).

    Args:
        logits: Logits of the owned vertices.
        graph: This rank's part of the graph.
        split: ``"train"``, ``"val"`` or ``"test"``.

    Returns:
        ``{f"{split}_acc": ..., f"{split}_loss": ...}``, the same on every rank.
    """
    m = graph.mask(split)
    with torch.no_grad():
        correct = (logits[m].argmax(1) == graph.y[m]).sum().double()
        loss = F.cross_entropy(logits[m].double(), graph.y[m], reduction="sum")
        acc = torch.stack([correct, loss, m.sum().double()]).cpu()
    allreduce_(acc, graph.comm)
    n = max(float(acc[2]), 1.0)
    return {f"{split}_acc": float(acc[0]) / n, f"{split}_loss": float(acc[1]) / n}
