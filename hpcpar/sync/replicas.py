"""The replica check: parameters that must be identical on several ranks are compared.

Every replicated parameter is the same on every rank of the world after each synchronised
step (the gradient sync hands every rank the same gradient, the optimizer is deterministic);
tensor-parallel shards are the same across the data axis. A drift — a rank that skipped a
step, a non-deterministic kernel, an op that escaped the spatial dispatch — would otherwise
show only as a slowly wrong model. :func:`check_replicas` hashes each parameter's bytes
(CRC-32, about 1 GB/s) and compares the hashes with one allgather per group; the training
loop runs it every ``[train] check_replicas_every`` steps and records its cost (``t_check``).
"""

from __future__ import annotations

import zlib

from hpcpar.errors import CommError

__all__ = ["check_replicas"]


def _digest(p) -> int:
    import torch

    t = p.detach().contiguous().view(-1)
    return zlib.crc32(t.view(torch.uint8).cpu().numpy().tobytes())


def check_replicas(model, grid, shards: frozenset[str] = frozenset()) -> None:
    """Raise on every rank if a parameter differs between ranks that must hold it alike.

    Collective over ``grid.comm`` (and ``grid.data_comm`` when there are shards: names of
    parameters sharded over the spatial group, compared across the data axis only). The
    CommError names the first differing parameter and the ranks that disagree with the
    lowest rank of its group.
    """
    everywhere: list[tuple[str, int]] = []
    per_data: list[tuple[str, int]] = []
    for name, p in model.named_parameters():
        (per_data if name in shards else everywhere).append((name, _digest(p)))
    problem = _first_drift(everywhere, grid.comm)
    if problem is None and shards:
        problem = _first_drift(per_data, grid.data_comm, "data-axis ")
    problems = grid.comm.allgather(problem)
    problem = next((p for p in problems if p), None)
    if problem:
        raise CommError(f"replica check: {problem}; the replicas drifted apart (a rank that "
                        "missed a step or an op that escaped the spatial dispatch)")


def _first_drift(pairs, comm, what: str = "") -> str | None:
    tables = comm.allgather([d for _, d in pairs])
    for i, (name, _) in enumerate(pairs):
        column = [t[i] for t in tables]
        if any(v != column[0] for v in column):
            ranks = [r for r, v in enumerate(column) if v != column[0]]
            return (f"parameter '{name}' differs on {what}rank(s) {ranks} from {what}rank 0 "
                    "of its group")
    return None
