"""PID 1 of a virtual node (hpcpar.testing.cluster): starts the node's ``slurmd`` and reaps
every orphaned process, as init does, so finished job processes never linger as zombies that
Slurm would take for unkillable tasks. Exits with ``slurmd``, which ends the node: the kernel
kills whatever else is left in the node's PID namespace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    child = subprocess.Popen(argv)

    def forward(signum, frame):
        if child.returncode is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return max(child.returncode, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
