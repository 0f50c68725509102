"""Cost of the collectives a step waits in: ring allreduce / all-gather over a link, and the
hierarchical gradient allreduce (intra-node ring, inter-node ring between node peers).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcpar.plan.machine import Machine

__all__ = ["BUCKET_BYTES", "STEP_COLLECTIVES", "ring_allreduce", "ring_gather",
           "allreduce_time"]

BUCKET_BYTES = 25 * 2**20
#: collectives every multi-rank step waits in: the gradient sync's last wait and the loss /
#: stop-flag allreduce (each waits ``Machine.sync_delay`` on oversubscribed cores)
STEP_COLLECTIVES = 2


def ring_allreduce(nbytes: float, p: int, link, messages_per_step: int = 1) -> float:
    """Ring allreduce: 2(p-1) steps, each moving nbytes/p over ``link``."""
    if p <= 1 or nbytes == 0:
        return 0.0
    return 2 * (p - 1) * (messages_per_step * link.alpha + nbytes / p / link.beta)


def ring_gather(nbytes: float, p: int, link) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` in all: p-1 steps of nbytes/p."""
    if p <= 1 or nbytes == 0:
        return 0.0
    return (p - 1) * (link.alpha + nbytes / p / link.beta)


def allreduce_time(nbytes: float, ranks: int, machine: Machine) -> float:
    """Predicted seconds of one gradient allreduce of ``nbytes`` over ``ranks``, hierarchical:
    intra-node reduce, inter-node ring between node peers, intra-node broadcast."""
    per_node = min(ranks, machine.ranks_per_node)
    nodes = math.ceil(ranks / per_node)
    buckets = max(1, math.ceil(nbytes / BUCKET_BYTES))
    intra = ring_allreduce(nbytes, per_node, machine.intra, buckets)
    inter = ring_allreduce(nbytes / per_node, nodes, machine.inter, buckets) if nodes > 1 else 0
    return intra + inter
