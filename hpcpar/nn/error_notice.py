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

- a rank that raises in the same forward itself (a refusal every rank makes, at the same op)
  ignores the others' messages about it: nothing waits on it, and the caller may go on;
- otherwise the job cannot go on (the ranks that raised left messages of that forward
  unanswered, which a later exchange would read), so the told rank stops: it prints the line
  as hpcpar's CLI prints an error (``hpcpar: error: <line>``) and exits with
  ``LayerError``'s exit code, and ``mpiexec`` ends the job, never a hang. It stops where it
  waits inside a collective (in hpcpar's communication layers) once every other rank of its
  group has told (it waits for the dead), or after :data:`GRACE` seconds there when only
  some have (it may wait for a slow live rank still on its way to the same refusal); and at
  the start of its next forward when it finished the forward the others raised in.

A told rank never raises at another op than the one that raised: ranks ahead of it may have
sent it messages of ops it would skip, which a later exchange would read.
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

__all__ = ["GRACE", "DEAD_WAIT", "POLL", "Notices", "notices_for", "stop"]

#: Seconds a rank told by some (not all) of its group may wait in a collective before it exits.
GRACE = 60.0
#: Seconds a rank told by all of its group waits in a collective before it exits.
DEAD_WAIT = 0.5
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
    """One spatial group's error messages, on a duplicate of its communicator (collective)."""

    def __init__(self, comm: Any):
        self.comm = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.forwards = 0       # spatialized forwards on this grid so far (the same on every rank)
        self.raised_at = -1     # the last forward this rank raised in (or was told of)
        self.pending: tuple[int, str] | None = None   # told, not raised yet
        self.since = 0.0
        self.tellers: set[int] = set()   # the ranks that told of the pending forward
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
        self._sent = [self.comm.isend((self.forwards, line, self.rank), r, _TAG)
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
        """At the start of a forward (the main thread): stop if this rank finished a forward
        another rank raised in (:func:`stop`)."""
        with _LOCK:
            told = self.pending
            if told is None or told[0] >= self.forwards or told[0] <= self.raised_at:
                return
        stop(told[1])

    def _take(self) -> None:
        """Take the messages that arrived: the first about a forward this rank has not raised
        in is pending until raised; its tellers are counted."""
        while True:
            flag, msg = self._recv.test()
            if not flag:
                return
            self._recv = self._post()
            forward, line, sender = msg
            with _LOCK:
                if forward <= self.raised_at:
                    continue
                if self.pending is None:
                    self.pending, self.since = (forward, line), time.monotonic()
                    self.tellers = set()
                if self.pending[0] == forward:
                    self.tellers.add(sender)

    def poll(self, blocked_since: float) -> None:
        """The watcher: take messages; stop when one waits unraised while the main thread has
        waited in a collective :data:`DEAD_WAIT` seconds (every other rank told: it waits for
        the dead) or :data:`GRACE` seconds (some told)."""
        self._take()
        told = self.pending
        if told is None:
            return
        waited = time.monotonic() - max(self.since, blocked_since)
        if waited > (DEAD_WAIT if len(self.tellers) >= self.size - 1 else GRACE):
            stop(told[1])

    def close(self) -> None:
        self._recv.Cancel()


def stop(line: str) -> None:
    """End this process as hpcpar's CLI ends on an error: the job cannot go on."""
    sys.stdout.flush()
    print(f"hpcpar: error: {line}", file=sys.stderr, flush=True)
    os._exit(LayerError.exit_code)


def notices_for(grid: Any) -> Notices:
    """The grid's :class:`Notices`, made on its first spatialized forward (collective: every rank of
    the grid runs that forward) and watched from then on. They go to the ranks of this rank's
    spatial group: those its forward waits for (another data group runs its forward on its own; a
    rank there that stops is named by the gradient sync's stall detector)."""
    found = _BY_GRID.get(grid)
    if found is None:
        found = _BY_GRID[grid] = Notices(grid.spatial_comm)
        with _LOCK:
            _WATCHED.append(found)
        from mpi4py import MPI

        # a watcher thread only where MPI may be called from it while the main thread calls it
        if not _THREAD and MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            _THREAD.append(threading.Thread(target=_watch, name="hpcpar-notices", daemon=True))
            _THREAD[0].start()
            atexit.register(_stop)   # after mpi4py's own: runs before MPI_Finalize
    return found


def _watch() -> None:
    main = threading.main_thread().ident or 0
    blocked_since = float("inf")
    while not _STOP.wait(POLL):
        frame = sys._current_frames().get(main)   # its innermost Python frame
        waiting = frame is not None and frame.f_code.co_filename.startswith(_COLLECTIVES)
        del frame   # held until the next look, it would keep a returned frame's tensors alive
        if not waiting:
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
