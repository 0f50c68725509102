"""What a checkpointed segment received in its forward pass, replayed when it is recomputed.

Activation checkpointing runs a segment's forward a second time during backward. Its halo
exchanges and collectives (ghost faces, batch-norm statistics, global reductions, the
repartition of a pad) would then send every message again: MPI traffic the forward already
paid for, inside the backward's critical path. A :class:`Tape` removes it: while the first
forward of a segment runs under ``tape.recording()``, every communicating call that goes
through :func:`received` (the halo exchanges, ``comm.allreduce_``, ``allgather``,
``allgatherv``, ``alltoallv``) appends what it received; under ``tape.replaying()`` the same
calls, in the same order, return the recorded results and send nothing.

A recomputed segment makes the same calls in the same order (same inputs, same RNG state):
each entry carries a signature (what call, which shapes) and a mismatch raises a
``LayerError`` on every rank rather than feeding wrong faces to a convolution. The recorded
tensors are the faces themselves (the halo's share of the activations) and the small
statistics; they live as long as the segment's autograd graph, so they are freed with it after
its backward.

Messages sent while a tape replays are counted in ``COUNTERS.recompute_msgs`` /
``recompute_bytes`` (the step records' columns): 0 proves the reuse. :data:`REUSE` turns the
reuse off (tests show the counter then sees the messages).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from hpcpar.errors import LayerError
from hpcpar.parallel.counters import COUNTERS

__all__ = ["Tape", "received", "recorded", "record", "taped", "replaying", "count_sent", "REUSE"]

T = TypeVar("T")

#: False: a replaying tape lets the calls communicate again (a test switch: the counter then
#: sees the recomputation's messages).
REUSE = True

_ACTIVE: ContextVar[tuple[Tape, bool] | None] = ContextVar("hpcpar_replay_tape", default=None)


class Tape:
    """The received results of one segment's communicating calls, in call order."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, Any]] = []
        self._next = 0

    @contextmanager
    def recording(self) -> Iterator[Tape]:
        """The segment's first forward: calls communicate and their results are kept."""
        self.entries.clear()
        token = _ACTIVE.set((self, False))
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextmanager
    def replaying(self) -> Iterator[Tape]:
        """A recomputation: calls return the recorded results, in order, without messages.
        Re-enterable (a graph kept with ``retain_graph`` is recomputed once per backward)."""
        self._next = 0
        token = _ACTIVE.set((self, True))
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def _take(self, sig) -> Any:
        if self._next >= len(self.entries) or self.entries[self._next][0] != sig:
            had = self.entries[self._next][0] if self._next < len(self.entries) else "nothing"
            raise LayerError(f"activation checkpointing: the recomputed segment's communication "
                             f"#{self._next + 1} is {sig}, its forward pass made {had} (a "
                             f"segment must make the same calls when it is run again: no "
                             f"control flow on data or on a counter inside it)")
        out = self.entries[self._next][1]
        self._next += 1
        return out


def replaying() -> bool:
    """Whether a recomputation is running under a replaying tape (messages then count)."""
    active = _ACTIVE.get()
    return active is not None and active[1]


def count_sent(nbytes: int, messages: int = 1) -> None:
    """Count messages sent while a tape replays (the proof that recomputation sends none)."""
    if replaying():
        COUNTERS.recompute_msgs += messages
        COUNTERS.recompute_bytes += int(nbytes)


def recorded(sig) -> tuple[bool, Any]:
    """For calls that post messages and wait later (overlapped with compute): ``(True,
    result)`` when a replaying tape holds the call's result, else ``(False, None)``: then
    communicate, and :func:`record` the result. ``sig`` (name and shapes) is checked on
    replay."""
    active = _ACTIVE.get()
    if active is None or not active[1] or not REUSE:
        return False, None
    return True, active[0]._take(sig)


def record(sig, result: Any) -> None:
    """Keep a call's received ``result`` when a tape records (see :func:`recorded`)."""
    active = _ACTIVE.get()
    if active is not None and not active[1]:
        active[0].entries.append((sig, result))


def received(sig, communicate: Callable[[], T], keep: Callable[[T], Any] = lambda r: r,
             restore: Callable[[Any], T] = lambda r: r) -> T:
    """Run ``communicate()``, or replay what it received (module docstring). ``sig`` (name and
    shapes) is checked on replay; ``keep`` is what to record of the result (default: the
    result itself, for fresh tensors nobody writes to afterwards), ``restore`` turns a record
    back into the result."""
    if _ACTIVE.get() is None:
        return communicate()
    hit, value = recorded(sig)
    if hit:
        return restore(value)
    out = communicate()
    record(sig, keep(out))
    return out


def taped(name: str, in_place: bool = False):
    """Decorate a collective of :mod:`hpcpar.parallel.comm` (first argument: the tensor) so a
    tape records and replays it. ``in_place``: the result is written into the first argument
    (``allreduce_``): a copy is recorded and written back on replay. Returned fresh tensors
    are recorded as they are and cloned on replay (the record stays intact for a second
    backward through a kept graph)."""
    def deco(fn):
        @functools.wraps(fn)
        def inner(t, *args, **kwargs):
            if _ACTIVE.get() is None:
                return fn(t, *args, **kwargs)

            def communicate():
                comm = next((a for a in args if hasattr(a, "Get_size")), kwargs.get("comm"))
                if comm is None or comm.Get_size() > 1:   # one rank: no message
                    count_sent(t.numel() * t.element_size())
                return fn(t, *args, **kwargs)

            sig = (name, tuple(t.shape), str(t.dtype))
            if not in_place:
                return received(sig, communicate, restore=lambda r: r.clone())
            out = received(sig, communicate, lambda r: r.clone(), lambda r: r)
            return out if out is t else t.copy_(out)
        return inner
    return deco
