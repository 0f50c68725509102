"""Running Slurm's client commands (``sbatch``, ``scontrol``, ``squeue``, ``sacct``), retried while
the controller is briefly out of reach.

A busy or restarting ``slurmctld`` makes a client command fail with a message such as "Socket timed
out on send/recv operation"; the same command a few seconds later works. Those failures are retried
with bounded exponential backoff; anything else (a rejection: bad partition, invalid option, unknown
job) is returned at once for the caller to report. Slurm's clients exit 1 for every error, so the
message, not the exit code, tells the two apart. ``sbatch`` is the one command that creates
something: when its reply timed out the job may have been accepted, so that case is not retried but
reported with what to check."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence

from hpcpar.errors import LaunchError

__all__ = ["TRANSIENT", "run_slurm", "transient"]

#: Seconds to wait before each retry: at most len(DELAYS) retries, about 7 s in all.
DELAYS = (1.0, 2.0, 4.0)

#: Messages (lower case) of failures that say nothing about the request: try again.
TRANSIENT = ("socket timed out", "unable to contact slurm controller",
             "resource temporarily unavailable", "temporarily unable to accept job",
             "zero bytes were transmitted or received", "connection refused",
             "communication connection failure")

#: Of those, the ones after which the controller may have acted on the request anyway.
UNSURE = ("socket timed out", "zero bytes were transmitted or received")


def transient(stderr: str) -> str | None:
    """The transient-failure message in ``stderr``, or None for any other failure."""
    text = stderr.lower()
    return next((m for m in TRANSIENT if m in text), None)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"


def _once(argv: Sequence[str], env, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} not found: run this on a Slurm login node "
                          "(or use --dry-run)") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{argv[0]} did not answer within {timeout:.0f} s") from None


def run_slurm(argv: Sequence[str], env: Mapping[str, str] | None = None,
              timeout: float = 60, delays: Sequence[float] = DELAYS
              ) -> subprocess.CompletedProcess:
    """Run a Slurm client command (``env`` None: this process's), ``timeout`` seconds per attempt,
    retrying transient failures after ``delays``; return it finished: a success, or a failure that
    is not transient (the caller reports it). :class:`LaunchError` when the command is missing or
    hangs, a transient failure outlasted every retry, or ``sbatch``'s reply timed out (the job may
    exist: not resubmitted blindly)."""
    name, waits = os.path.basename(argv[0]), list(delays)
    while True:
        proc = _once(argv, env, timeout)
        why = transient(proc.stderr) if proc.returncode != 0 else None
        if why is None:
            return proc
        if name == "sbatch" and why in UNSURE:
            raise LaunchError(f"sbatch's reply timed out ({_last_line(proc)}): the job may have "
                              f"been submitted; check `squeue --me` before submitting again")
        if not waits:
            raise LaunchError(f"{name} failed {len(delays) + 1} times on a transient Slurm error "
                              f"(last: {_last_line(proc)}); try again when the controller answers")
        time.sleep(waits.pop(0))

