"""An error at a spatial op on some ranks only: every rank of the group stops with its line.

A refusal that depends on global shapes alone is raised by every rank at the same op. A torch
error can be raised by some ranks only: its sizes are this rank's piece's (a view of a piece
back to a global shape fits one rank's piece, not another's), or its values are (a label
out of ``F.one_hot``'s range in one rank's piece). The other ranks would go on to the next
halo exchange or reduction and wait there for ever for the rank that stopped. So a rank
whose spatial op raises tells every other rank of its spatial group first
(:meth:`Notices.tell`: a message on a communicator of its own, with the number of the forward
it raised in), and each process watches for such messages (one daemon thread, polling every
:data:`POLL` seconds, where MPI was initialised for threads; elsewhere at the start of each
forward):

- a rank still running ops raises the same :class:`~hpcpar.errors.LayerError` at its next op,
  or at the start of its next forward, before that forward's first collective
  (:meth:`Notices.check`, from the dispatcher and the spatialized model's forward);
- a rank waiting inside a collective (in hpcpar's communication layers) for the rank that
  stopped cannot raise (MPI does not return): once it has waited there :data:`GRACE` seconds
  it prints the line as hpcpar's CLI prints an error (``hpcpar: error: <line>``) and exits
  with ``LayerError``'s exit code; ``mpiexec`` then ends the job, never a hang. A rank told
  while it works elsewhere (its reference computation, data loading) is left to raise.

A rank whose forward raised itself (a refusal every rank makes) ignores the others' messages
about that forward: nothing waits on it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from typing import Any

from hpcpar.errors import LayerError

__all__ = ["GRACE", "POLL", "Notices", "notices_for"]

#: Seconds a rank told of another rank's error may wait in a collective before it exits.
GRACE = 3.0
#: Seconds between the watcher thread's looks.
POLL = 0.05
_TAG = 6104
_BUF = 1 << 16   # bytes of one message (a line and a number, pickled)

#: Where the main thread's innermost Python frame is while it waits inside MPI for other
#: ranks (hpcpar's communication layers: a call into mpi4py has no Python frame of its own).
_COLLECTIVES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  d, "") for d in ("parallel", "sync"))

_BY_GRID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WATCHED: list[Notices] = []
_LOCK = threading.Lock()
_THREAD: list[threading.Thread] = []
_STOP = threading.Event()


class Notices:
    """One spatial group's error messages: a duplicate of its communicator (collective
    construction)."""

    def __init__(self, comm: Any):
        self.comm = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.forwards = 0       # spatialized forwards on this grid so far (the same on every rank)
        self.raised_at = -1     # the last forward this rank raised in (or was told of)
        self.pending: tuple[int, str] | None = None   # told, not raised yet
        self.since = 0.0
        self._sent: list[Any] = []
        self._recv = self._post()

    def _post(self):
        from mpi4py import MPI

        return self.comm.irecv(bytearray(_BUF), MPI.ANY_SOURCE, _TAG)

    def tell(self, line: str) -> None:
        """This rank raises ``line`` in the current forward: tell every other rank (once)."""
        with _LOCK:
            if self.raised_at >= self.forwards:
                return
            self._raised(self.forwards)
        line = line[:_BUF // 8]   # a message fits the receive buffer whatever its text
        self._sent = [self.comm.isend((self.forwards, line), r, _TAG)
                      for r in range(self.size) if r != self.rank]

    def raised(self, forward: int) -> None:
        """This rank's forward number ``forward`` raised: others' messages about it are void."""
        with _LOCK:
            self._raised(forward)

    def _raised(self, forward: int) -> None:
        self.raised_at = max(self.raised_at, forward)
        if self.pending is not None and self.pending[0] <= self.raised_at:
            self.pending = None

    def look(self) -> None:
        """Where MPI allows no watcher thread: look for messages (the main thread)."""
        if not _THREAD:
            self._take()

    def check(self) -> None:
        """Raise the error another rank was told to raise, if any (the main thread)."""
        with _LOCK:
            told, self.pending = self.pending, None
            if told is None or told[0] <= self.raised_at:
                return
            self.raised_at = told[0]
        raise LayerError(told[1])

    def _take(self) -> None:
        """Take the messages that arrived (the first about a forward this rank has not
        raised in is pending until raised)."""
        while True:
            flag, msg = self._recv.test()
            if not flag:
                return
            self._recv = self._post()
            with _LOCK:
                if msg[0] > self.raised_at and self.pending is None:
                    self.pending, self.since = (msg[0], msg[1]), time.monotonic()

    def poll(self, blocked_since: float) -> None:
        """The watcher: take messages; exit when one waits unraised while the main thread
        has waited in a collective for :data:`GRACE` seconds (``blocked_since``: since when)."""
        self._take()
        told = self.pending
        if told is not None and time.monotonic() - max(self.since, blocked_since) > GRACE:
            sys.stdout.flush()
            print(f"hpcpar: error: {told[1]}", file=sys.stderr, flush=True)
            os._exit(LayerError.exit_code)

    def close(self) -> None:
        self._recv.Cancel()


def notices_for(grid: Any) -> Notices:
    """The grid's :class:`Notices`, made on its first spatialized forward (collective: every
    rank of the grid runs that forward) and watched from then on. They go to the ranks of
    this rank's spatial group: those its forward waits for (another data group runs its
    forward on its own; a rank there that stops is named by the gradient sync's stall
    detector)."""
    found = _BY_GRID.get(grid)
    if found is None:
        found = _BY_GRID[grid] = Notices(grid.spatial_comm)
        with _LOCK:
            _WATCHED.append(found)
        if not _THREAD and _threads_allowed():
            _THREAD.append(threading.Thread(target=_watch, name="hpcpar-notices", daemon=True))
            _THREAD[0].start()
            atexit.register(_stop)   # after mpi4py's own: runs before MPI_Finalize
    return found


def _threads_allowed() -> bool:
    """Whether MPI may be called from the watcher thread while the main thread calls it."""
    from mpi4py import MPI

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def _watch() -> None:
    main = threading.main_thread().ident or 0
    blocked_since = float("inf")
    while not _STOP.wait(POLL):
        frame = sys._current_frames().get(main)   # its innermost Python frame
        if frame is None or not frame.f_code.co_filename.startswith(_COLLECTIVES):
            blocked_since = float("inf")
        elif blocked_since == float("inf"):
            blocked_since = time.monotonic()
        for n in list(_WATCHED):
            n.poll(blocked_since)


def _stop() -> None:
    _STOP.set()
    if _THREAD:
        _THREAD[0].join()
    for n in _WATCHED:
        n.close()
