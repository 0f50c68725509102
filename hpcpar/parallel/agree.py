"""Agree on an error across ranks: a step that fails on one rank fails on every rank.

A collective step that raises on one rank and not on the others leaves them waiting in their
next collective: a hang, not an error. :func:`agree` runs the step (on every rank, or on one
root rank whose result it shares), collects each rank's :class:`~hpcpar.errors.HpcparError`
with one object collective, and raises the same one-line error, of the first failing rank's
class, on every rank. In the spirit of the ``_DistWrapper`` of torch's distributed checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hpcpar.errors import CommError, HpcparError

__all__ = ["agree"]

T = TypeVar("T")


def ranks_text(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 1, 3``: the ranks an agreed error names."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def agree(comm: Any, step: Callable[..., T], *args: Any, root: int | None = None,
          what: str | None = None, catch: type[Exception] = HpcparError,
          foreign_as: type[HpcparError] = CommError) -> T:
    """Run ``step(*args)`` so that an :class:`~hpcpar.errors.HpcparError` it raises on any
    rank is raised alike on every rank of ``comm``, never left for the others to hang on.

    Collective over ``comm`` (one allgather, or one broadcast with ``root``): an mpi4py
    communicator, or anything with ``Get_rank``, ``Get_size``, ``allgather`` and ``bcast``;
    None runs ``step`` in this process alone. Returns what ``step`` returned on this rank.

    ``root``: run ``step`` on this rank only and give every rank its result (a file that one
    rank writes for all). ``catch``: what counts as a failure (hpcpar's errors, or wider, e.g.
    ``Exception``); other exceptions pass through unchanged (a bug, not a user error).

    On a failure every rank raises the first failing rank's class (``foreign_as`` for one
    not hpcpar's; the rank it happened on re-raises its own, traceback and all) and message,
    prefixed ``"<what> failed on rank 3: "`` (or ``"rank 3: "``) when not every rank failed
    (with ``root``, the root's error as it is).
    """
    if comm is None:
        return step(*args)
    result: Any = None
    mine: Exception | None = None
    # (class, message): the class only when it is hpcpar's (a foreign one may not unpickle)
    failure: tuple[type[HpcparError] | None, str] | None = None
    if root is None or comm.Get_rank() == root:
        try:
            result = step(*args)
        except catch as exc:
            mine = exc
            failure = (type(exc) if isinstance(exc, HpcparError) else None, str(exc))
    if root is not None:
        failure, result = comm.bcast((failure, result), root=root)
        failures = [failure]
    else:
        failures = comm.allgather(failure)
    failed = [r for r, f in enumerate(failures) if f is not None]
    if not failed:
        return result
    if mine is not None and not isinstance(mine, HpcparError):
        raise mine
    cls, msg = failures[failed[0]]
    if len(failed) < len(failures):
        named = ranks_text(failed)
        msg = f"{what} failed on {named}: {msg}" if what else f"{named}: {msg}"
    raise (cls or foreign_as)(msg)
