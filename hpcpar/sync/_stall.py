"""Stall detector: a gradient sync that waits too long names the missing ranks and aborts.

Every rank publishes "I have reached gradient sync #k" in a one-sided MPI window (one int64
per rank, written with an atomic accumulate to itself, ~10-20 us per step). Before a rank
blocks on a sync it arms a watchdog thread; if the wait lasts longer than
``HPCPAR_STALL_TIMEOUT`` seconds, the watchdog reads every rank's counter (request-based
one-sided reads with a deadline, so a rank that is not even inside MPI is reported as not
answering instead of hanging the reader), prints one line naming the ranks that have not
reached the sync and where they are, then calls ``MPI_Abort`` so the whole job exits
non-zero instead of hanging silently.

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


def stall_timeout(env=None) -> float:
    """Seconds from ``HPCPAR_STALL_TIMEOUT`` (0 = off)."""
    return _env.get("HPCPAR_STALL_TIMEOUT", env)


def describe(rank: int, step: int, counters, waited: float, timeout: float, what: str) -> str:
    """The one-line report; ``counters[r]`` is rank r's last reached step or None."""
    behind = {r: c for r, c in enumerate(counters) if c is None or c < step}
    head = (f"hpcpar: stall: rank {rank} waited {waited:.1f} s (HPCPAR_STALL_TIMEOUT="
            f"{timeout:g}) in {what} #{step}")
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
        self.win: MPI.Win | None = None
        if self.timeout > 0 and self.size > 1:
            self.win = MPI.Win.Allocate(8, 8, comm=comm)
            self.win.Lock_all(MPI.MODE_NOCHECK)
            # unified memory model: a plain store + Win_sync publishes (~0.3 us, vs ~5 us for
            # an accumulate to self); otherwise an atomic accumulate
            self._local: np.ndarray | None = None
            if self.win.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED:
                memory = self.win.tomemory()  # the buffer protocol, typed for Python 3.12+ only
                self._local = np.frombuffer(memory, dtype=np.int64)  # type: ignore[call-overload]
            self._post(0)
            # strong: an unreferenced window must still be freed
            self._release = free_at_exit(self._free)
        self._armed_at: float | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    # -- counters ----------------------------------------------------------------------------
    def _post(self, step: int) -> None:
        from mpi4py import MPI

        win = self.win
        assert win is not None  # posted only while the window is open
        if self._local is not None:
            self._local[0] = step
            win.Sync()
        else:
            win.Accumulate(np.array([step], dtype=np.int64), self.rank, op=MPI.REPLACE)
            win.Flush(self.rank)

    def reached(self, step: int) -> None:
        """This rank has reached sync ``step`` (cheap; call once per step)."""
        self.step = step
        if self.win is not None:
            self._post(step)

    def read(self, deadline: float = READ_DEADLINE) -> list:
        """Every rank's last reached step (None for a rank that did not answer in time)."""
        from mpi4py import MPI

        win = self.win
        assert win is not None  # read only while the window is open
        zeros = np.zeros(1, dtype=np.int64)
        bufs = [np.full(1, -1, dtype=np.int64) for _ in range(self.size)]
        reqs = [win.Rget_accumulate(zeros, bufs[r], r, op=MPI.NO_OP)
                for r in range(self.size)]
        done = [False] * self.size
        end = time.monotonic() + deadline
        while not all(done) and time.monotonic() < end:
            for r in range(self.size):
                done[r] = done[r] or reqs[r].Test()
            time.sleep(0.002)
        return [int(b[0]) if ok else None for b, ok in zip(bufs, done)]

    # -- watchdog ----------------------------------------------------------------------------
    def arm(self) -> None:
        """Start timing a wait at the current step (no-op when disabled). Lock-free: the
        watchdog polls, so arming costs nothing on the training thread."""
        if self.win is None:
            return
        self._armed_at = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hpcpar-stall",
                                            daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        self._armed_at = None

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 10)
        while not self._stopped:
            time.sleep(poll)
            armed = self._armed_at
            if armed is not None and time.monotonic() - armed > self.timeout:
                self._abort(time.monotonic() - armed)
                return

    def _abort(self, waited: float) -> None:
        line = describe(self.rank, self.step, self.read(), waited, self.timeout, self.what)
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
        assert self.win is not None  # released once
        self.win.Unlock_all()
        self.win.Free()
        self.win = None
