"""Stall detector: a gradient sync that waits too long names the missing ranks and aborts.

Every rank publishes "I have reached gradient sync #k" in a one-sided MPI window (one int64
per rank, written with an atomic accumulate to itself, ~10-20 us per step). Before a rank
blocks on a sync it arms a watchdog thread; if the wait lasts longer than
``HPCPAR_STALL_TIMEOUT`` seconds, the watchdog reads every rank's counter (request-based
one-sided reads with a deadline, so a rank that is not even inside MPI is reported as not
answering instead of hanging the reader), prints one line naming the ranks that have not
reached the sync and where they are, then calls ``MPI_Abort`` so the whole job exits
non-zero instead of hanging silently. A rank that has reached the sync but stopped inside it
(suspended, frozen) still shows the sync's number, so each watchdog also beats a second counter
every poll: the one whose beat stands still between two reads is named as stopped.

``HPCPAR_STALL_TIMEOUT``: seconds (default 600); ``0`` or ``off`` disables the detector.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from hpcpar import _env
from hpcpar.errors import EXIT_FAILED
from hpcpar.parallel.buffers import free_at_exit

READ_DEADLINE = 5.0  # seconds to wait for the counters of the other ranks
ABORT_GRACE = 1.0  # seconds between printing the stall line and MPI_Abort
BEATS = 3  # polls of the watchdog a live rank beats at least once in, between two reads


def stall_timeout(env=None) -> float:
    """Seconds from ``HPCPAR_STALL_TIMEOUT`` (0 = off)."""
    return _env.get("HPCPAR_STALL_TIMEOUT", env)


def describe(rank: int, step: int, counters, waited: float, timeout: float, what: str,
             stopped=()) -> str:
    """The one-line report; ``counters[r]`` is rank r's last reached step or None;
    ``stopped``: the ranks whose heartbeat stood still (reached, but not running)."""
    # a stopped rank still counts as behind when it stopped before this sync: the line then
    # says both, where it stopped and that it has not reached this one
    behind = {r: c for r, c in enumerate(counters)
              if (c is None and r not in stopped) or (c is not None and c < step)}
    head = (f"hpcpar: stall: rank {rank} waited {waited:.1f} s (HPCPAR_STALL_TIMEOUT="
            f"{timeout:g}) in {what} #{step}")
    if stopped:
        ranks = ", ".join(str(r) for r in stopped)
        head += (f"; rank(s) {ranks} stopped running (at {what} "
                 f"{', '.join(f'#{counters[r]}' for r in stopped)}: no heartbeat; suspended "
                 f"or frozen?)")
        if not behind:
            return head + "; aborting the job"
    if not behind:
        return (head + "; every rank has reached it, so the ranks disagree about what to "
                "reduce (different models or a rank-dependent extra backward?); aborting the "
                "job")
    parts = []
    for r, c in behind.items():
        parts.append(f"rank {r} did not answer (busy outside MPI?)" if c is None else
                     f"rank {r} is at #{c}")
    ranks = ", ".join(str(r) for r in behind)
    return (f"{head}; rank(s) {ranks} have not reached {what} #{step} ({'; '.join(parts)}); "
            "aborting the job")


class StallMonitor:
    """Per-communicator arrival counters plus a watchdog. Collective construction."""

    def __init__(self, comm, timeout: float | None = None, what: str = "gradient sync"):
        from mpi4py import MPI

        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = stall_timeout() if timeout is None else float(timeout)
        self.what = what
        self.step = 0
        self._poll = min(1.0, self.timeout / 10)     # the watchdog's period (and heartbeat's)
        self.win: MPI.Win | None = None
        if self.timeout > 0 and self.size > 1:
            self.win = MPI.Win.Allocate(16, 8, comm=comm)    # [reached step, heartbeat]
            self.win.Lock_all(MPI.MODE_NOCHECK)
            # unified memory model: a plain store + Win_sync publishes (~0.3 us, vs ~5 us for
            # an accumulate to self); otherwise an atomic accumulate
            self._local: np.ndarray | None = None
            if self.win.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED:
                memory = self.win.tomemory()  # the buffer protocol, typed for Python 3.12+ only
                self._local = np.frombuffer(memory, dtype=np.int64)  # type: ignore[call-overload]
            self._post(0)
            self._post(0, 1)
            # strong: an unreferenced window must still be freed
            self._release = free_at_exit(self._free)
        self._armed_at: float | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._beat_lock = threading.Lock()   # no beat once the window is freed
        self._beats = 0

    def _post(self, value: int, slot: int = 0) -> None:
        """Publish ``value`` in this rank's ``slot`` (0: the reached step, 1: the heartbeat)."""
        from mpi4py import MPI

        win = self.win
        assert win is not None  # posted only while the window is open
        if self._local is not None:
            self._local[slot] = value
            win.Sync()
        else:
            win.Accumulate(np.array([value], dtype=np.int64), self.rank, target=slot,
                           op=MPI.REPLACE)
            win.Flush(self.rank)

    def reached(self, step: int) -> None:
        """This rank has reached sync ``step`` (cheap; call once per step)."""
        self.step = step
        if self.win is not None:
            self._post(step)

    def read(self, deadline: float = READ_DEADLINE) -> list:
        """Every rank's ``(last reached step, heartbeat)`` (None for a rank that did not
        answer in time)."""
        from mpi4py import MPI

        win = self.win
        assert win is not None  # read only while the window is open
        zeros = np.zeros(2, dtype=np.int64)
        bufs = [np.full(2, -1, dtype=np.int64) for _ in range(self.size)]
        reqs = [win.Rget_accumulate(zeros, bufs[r], r, op=MPI.NO_OP)
                for r in range(self.size)]
        done = [False] * self.size
        end = time.monotonic() + deadline
        while not all(done) and time.monotonic() < end:
            for r in range(self.size):
                done[r] = done[r] or reqs[r].Test()
            time.sleep(0.002)
        return [(int(b[0]), int(b[1])) if ok else None for b, ok in zip(bufs, done)]

    def arm(self) -> None:
        """Start timing a wait at the current step (no-op when disabled). Lock-free: the
        watchdog polls, so arming costs nothing on the training thread."""
        if self.win is None:
            return
        self._armed_at = time.monotonic()
        if self._thread is None:
            with self._beat_lock:
                self._beats = 1
                self._post(1, 1)    # from now on a still heartbeat means a stopped process
            self._thread = threading.Thread(target=self._watch, name="hpcpar-stall",
                                            daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        self._armed_at = None

    def _beat(self) -> None:
        """Sleep one poll, then tell the other ranks this process still runs."""
        time.sleep(self._poll)
        with self._beat_lock:
            if self.win is not None:
                self._beats += 1
                self._post(self._beats, 1)

    def _watch(self) -> None:
        while not self._stopped:
            self._beat()
            armed = self._armed_at
            if armed is not None and time.monotonic() - armed > self.timeout:
                self._abort(time.monotonic() - armed)
                return

    def _abort(self, waited: float) -> None:
        first = self.read()
        for _ in range(BEATS):
            self._beat()        # this rank runs: the others may be reading it meanwhile
        last = self.read()
        stopped = [r for r, (a, b) in enumerate(zip(first, last))
                   if r != self.rank and a is not None and b is not None and 0 < a[1] == b[1]]
        counters = [None if v is None else v[0] for v in last]
        line = describe(self.rank, self.step, counters, waited, self.timeout, self.what,
                        stopped)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # the launcher forwards output asynchronously and MPI_Abort tears it down: give it
        # a moment, or the one line that says what happened can be lost (seen under load)
        time.sleep(ABORT_GRACE)
        self.comm.Abort(EXIT_FAILED)
        os._exit(EXIT_FAILED)

    def close(self) -> None:
        """Stop the watchdog and free the window (collective). Done at exit for monitors
        still alive."""
        self._armed_at = None
        self._stopped = True
        if self.win is not None:
            self._release()

    def _free(self) -> None:
        with self._beat_lock:
            assert self.win is not None  # released once
            self._stopped = True
            self._post(-1, 1)       # finished: no beat any more, but not stopped either
            self.win.Unlock_all()
            self.win.Free()
            self.win = None
