"""Driving ``hpcpar run`` as a user does, for the end-to-end tests: one CLI process in its own
session (so cleanup stops exactly what the test started, ranks included), its output in a
file, and helpers to find its ranks and fingerprint a run directory."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["CliRun", "rank_pids", "alive", "tree_hashes", "tiny_job_toml", "micro_job_toml"]


class CliRun:
    """``python -m hpcpar.cli run ARGS`` started in ``cwd``, stdout+stderr into ``out``."""

    def __init__(self, args, out: Path, cwd=None, env: dict | None = None):
        self.out_path = Path(out)
        self.out = open(self.out_path, "w")
        full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "hpcpar.cli", "run", *map(str, args)],
                                     cwd=cwd, stdout=self.out, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    def wait_until(self, pred, timeout: float = 240.0) -> bool:
        """Poll ``pred()`` until it holds, the run ends, or ``timeout`` seconds pass."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return True
            if self.proc.poll() is not None:
                return pred()
            time.sleep(0.05)
        return False

    def finish(self, timeout: float = 240.0) -> int:
        """The exit code (the run is killed if it outlives ``timeout``)."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        """Kill the CLI's session if it still runs (its launcher and ranks die with it)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()

    def log(self) -> str:
        return self.out_path.read_text()


def rank_pids(run_dir) -> list[int]:
    """PIDs of the rank processes (``python -m hpcpar.run.trainer``) of the run in
    ``run_dir``, from /proc."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd[1:3] == [b"-m", b"hpcpar.run.trainer"] and str(run_dir).encode() in cmd:
                pids.append(int(p.name))
    return pids


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def tree_hashes(d, skip=("hpcpar.lock",)) -> dict:
    """sha256 of every file under ``d`` by relative path (names in ``skip`` left out)."""
    d = Path(d)
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name not in skip}


def tiny_job_toml(*, data: int = 1, x: int = 2, kind: str = "cosmoflow", steps="8",
                  train: str = "", checkpoint: str = "") -> str:
    """A CosmoFlow job file that trains in about a second per step on 2 cores (synthetic
    16^3 x 2 volumes, 32 samples, global batch 4): the run and fault tests' common job.

    Args:
        data: The grid's data axis.
        x: The grid's x axis.
        kind: ``[model] kind`` (a test may register a variant).
        steps: ``[train] steps`` (a str keeps a ``{placeholder}`` for ``str.format``).
        train: Extra ``[train]`` lines.
        checkpoint: The ``[checkpoint]`` lines.

    Returns:
        The TOML text.
    """
    return f"""
[job]
name = "tiny"
[grid]
data = {data}
x = {x}
[model]
kind = "{kind}"
n_conv_blocks = 2
base_filters = 4
dense = [16]
[data]
source = "synthetic"
size = 16
channels = 2
samples = 32
[train]
steps = {steps}
global_batch = 4
lr = 0.003
log_every = 1
{train}
[checkpoint]
{checkpoint}
"""


def micro_job_toml(name: str, *, kind: str = "cosmoflow", steps: int = 4, train: str = "",
                   checkpoint: str = "every = 1\nkeep = 5") -> str:
    """A one-rank CosmoFlow job on 8^3 x 1 synthetic volumes (8 samples, global batch 2)
    that checkpoints every step: the resume and run-directory tests' common job, a fraction
    of a second per step.

    Args:
        name: ``[job] name``.
        kind: ``[model] kind`` (a test may register a variant, e.g. one that stops itself).
        steps: ``[train] steps``.
        train: Extra ``[train]`` lines.
        checkpoint: The ``[checkpoint]`` lines.

    Returns:
        The TOML text.
    """
    return f"""[job]
name = "{name}"
[grid]
data = 1
[model]
kind = "{kind}"
n_conv_blocks = 1
base_filters = 2
dense = [8]
[data]
source = "synthetic"
size = 8
channels = 1
samples = 8
[train]
steps = {steps}
global_batch = 2
{train}
[checkpoint]
{checkpoint}
"""
