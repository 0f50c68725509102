"""Ranks must agree about a graph before they exchange its rows.

Building a :class:`~hpcpar.graph.DistGraph` moves rows between ranks with counts each rank derives
from its own copy of the graph (or of the file's header). Ranks that hold different graphs (a
dataset sized by an unseeded RNG, two ranks reading different files) would pass mismatched counts to
``Alltoallv`` and wait there forever. One small allgather of a few facts and checksums first turns
that into one error line on every rank, naming what differs and which ranks hold which value."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from hpcpar.errors import CommError

__all__ = ["check_agree", "digest"]


def digest(*arrays: Any) -> str:
    """A short BLAKE2b checksum of arrays' shapes, dtypes and bytes (order matters)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.data.cast("B"))
    return h.hexdigest()


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def check_agree(comm: Any, where: str, facts: dict[str, Any]) -> None:
    """Raise the same :class:`~hpcpar.errors.CommError` on every rank unless all hold alike
    ``facts`` (name -> a picklable value: counts, checksums). Collective over ``comm`` (one object
    allgather). The line names ``where`` (``"DistGraph.from_pyg"``) and each fact that differs with
    the value each group of ranks holds, e.g. ``vertices: 120 on ranks 0, 2; 130 on rank 1``."""
    every = comm.allgather(facts)
    differ = []
    for name in facts:
        groups: dict[Any, list[int]] = {}
        for rank, f in enumerate(every):
            groups.setdefault(repr(f.get(name)), []).append(rank)
        if len(groups) > 1:
            held = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items())
            differ.append(f"{name}: {held}")
    if differ:
        raise CommError(f"{where}: the ranks hold different graphs ({' | '.join(differ)}); "
                        "every rank must be given the same graph (seed its generator, or "
                        "read one file)")
