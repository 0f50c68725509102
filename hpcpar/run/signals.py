"""The stop contract: SIGUSR1 / SIGTERM / SIGINT -> finish the step, checkpoint, exit
``EXIT_REQUEUE``.

A signal only sets a flag (:class:`StopRequest`). At the end of every step all ranks agree on
whether to stop with one small allreduce of their flags (the training loop's, which also
carries the loss), so every rank stops after the *same* step even when the signal reached only
some of them (srun and mpiexec forward it to all, ``kill`` of one rank does not). The loop
then writes a checkpoint and exits with
:data:`hpcpar.errors.EXIT_REQUEUE` (3); the Slurm batch script (and ``hpcpar run``) turn that
code into "requeue me, I will resume". Every exit code is listed in :mod:`hpcpar.errors`.

Ctrl-C (SIGINT) does the same: no KeyboardInterrupt, a checkpoint, exit 3. A second SIGINT
(more than half a second after the first, so one Ctrl-C delivered twice counts once) exits at
once with :data:`hpcpar.errors.EXIT_ABORTED` (130), without a checkpoint, after the
``on_abort`` callback (the loop uses it to mark meta.json).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

from hpcpar.errors import EXIT_ABORTED

__all__ = ["STOP_SIGNALS", "StopRequest"]

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
#: a second SIGINT later than this (seconds) after the first one aborts at once
REPEAT_AFTER_S = 0.5


class StopRequest:
    """Catches the stop signals while installed; ``received`` is the last one seen (0: none)."""

    def __init__(self, signals=STOP_SIGNALS, interrupt: bool = True):
        self.signals = tuple(signals) + ((signal.SIGINT,) if interrupt else ())
        self.received: int = 0          # number of the last stop signal seen by this rank
        self.on_abort: Callable[[], None] | None = None  # before exiting on a second SIGINT
        self._first_interrupt: float | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame):
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_interrupt is None:
                self._first_interrupt = now
            elif now - self._first_interrupt > REPEAT_AFTER_S:
                self._abort()
            else:
                return                      # the same Ctrl-C delivered twice
        self.received = signum

    def _abort(self) -> None:
        if callable(self.on_abort):
            self.on_abort()
        print("hpcpar: interrupted twice: exiting now, without a checkpoint", file=sys.stderr,
              flush=True)
        os._exit(EXIT_ABORTED)

    def install(self) -> StopRequest:
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    @staticmethod
    def name(signum: int) -> str:
        try:
            return signal.Signals(signum).name
        except ValueError:
            return str(signum)
