"""The stop contract: SIGUSR1 / SIGTERM -> finish the step, checkpoint, exit ``EXIT_REQUEUE``.

A signal only sets a flag (:class:`StopRequest`). At the end of every step all ranks agree on
whether to stop with one small allreduce of their flags (the training loop's, which also
carries the loss), so every rank stops after the *same* step even when the signal reached only
some of them (srun and mpiexec forward it to all, ``kill`` of one rank
does not). The loop then writes a checkpoint and exits with :data:`EXIT_REQUEUE`; the Slurm
batch script (and ``hpcpar run``) turn that code into "requeue me, I will resume".

Exit codes of ``hpcpar run`` and of every rank:

====  =====================================================================
0     finished all steps
1     crashed (a bug, or a rank died; MPI kills the rest)
2     user error (job file, command line, incompatible checkpoint): one line
3     stopped by SIGUSR1/SIGTERM after writing a checkpoint: requeue to resume
====  =====================================================================
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REQUEUE = 3
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Catches the stop signals while installed; ``received`` is the last one seen (0: none)."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: int = 0          # number of the last stop signal seen by this rank
        self._previous: dict = {}

    def _handler(self, signum, frame):
        self.received = signum

    def install(self) -> "StopRequest":
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
