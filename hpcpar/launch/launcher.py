"""Starting the ranks: ``mpiexec`` on a workstation, ``srun`` inside a Slurm allocation, nothing
when already running under MPI.

:func:`plan_launch` decides from the environment alone (no MPI import in the launcher):

* already under MPI with more than one rank (``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE`` or a Slurm
  step with ``SLURM_NTASKS`` > 1): run in this process (``direct``);
* inside an allocation (``SLURM_JOB_ID`` set) but not in a job step: ``srun`` with explicit
  ``--cpus-per-task`` (Slurm >= 22.05 no longer passes it on), ``--kill-on-bad-exit`` and
  ``--mpi=pmi2`` for the pip ``mpich`` wheel; extra flags from ``HPCPAR_SRUN_FLAGS``;
* otherwise ``mpiexec -n N`` (:func:`hpcpar.launch.mpiexec.find_mpiexec`), or in-process for N = 1.

``HPCPAR_LAUNCH=direct|srun|mpiexec`` forces a mode. Ranks read their place from
:func:`hpcpar.parallel.placement.rank_info` and take one GPU per local rank.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from hpcpar.errors import HpcparError
from hpcpar.parallel.placement import env_int, in_slurm_step

MODES = ("direct", "srun", "mpiexec")


class LaunchError(HpcparError, RuntimeError):
    """The ranks cannot be started as asked."""


def mpi_world_size(env=None) -> int:
    """Ranks of the MPI job this process already belongs to (1 when not launched by MPI)."""
    env = os.environ if env is None else env
    if in_slurm_step(env):
        return env_int(env, ["SLURM_NTASKS", "PMI_SIZE"], 1)
    return env_int(env, ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"], 1)


def default_ranks(env=None) -> int | None:
    """Rank count implied by the environment: an MPI world or a Slurm allocation's tasks."""
    env = os.environ if env is None else env
    world = mpi_world_size(env)
    if world > 1:
        return world
    if env.get("SLURM_JOB_ID") and not in_slurm_step(env):
        return env_int(env, ["SLURM_NTASKS"], None)
    return None


def plan_launch(n: int, env=None) -> str:
    """``direct``, ``srun`` or ``mpiexec`` for ``n`` ranks in this environment."""
    env = os.environ if env is None else env
    forced = env.get("HPCPAR_LAUNCH")
    if forced:
        if forced not in MODES:
            raise LaunchError(f"HPCPAR_LAUNCH={forced!r}: expected one of {', '.join(MODES)}")
        return forced
    world = mpi_world_size(env)
    if world > 1:
        if n != world:
            raise LaunchError(f"already running under MPI with {world} ranks, but -n {n} was "
                              f"asked: drop -n or launch {n} ranks")
        return "direct"
    if env.get("SLURM_JOB_ID") and not in_slurm_step(env):
        return "srun"
    return "direct" if n == 1 else "mpiexec"


def _uses_mpich_wheel() -> bool:
    from importlib import metadata

    try:
        metadata.version("mpich")
        return True
    except metadata.PackageNotFoundError:
        return False


def launch_command(mode: str, n: int, argv: list[str], *, cpus_per_task: int = 1,
                   gpus_per_node: int = 0, env=None) -> list[str]:
    """The full command line that starts ``argv`` on ``n`` ranks."""
    env = os.environ if env is None else env
    if mode == "mpiexec":
        from hpcpar.launch.mpiexec import find_mpiexec

        return [find_mpiexec(), "-n", str(n), *argv]
    if mode == "srun":
        cpt = env_int(env, ["SLURM_CPUS_PER_TASK"], cpus_per_task)
        cmd = ["srun", f"--ntasks={n}", f"--cpus-per-task={cpt}", "--kill-on-bad-exit=1"]
        mpi = env.get("HPCPAR_SRUN_MPI", "pmi2" if _uses_mpich_wheel() else "")
        if mpi:
            cmd.append(f"--mpi={mpi}")
        if gpus_per_node and "--gpus" not in env.get("HPCPAR_SRUN_FLAGS", ""):
            cmd.append("--gpus-per-task=1")
        cmd += shlex.split(env.get("HPCPAR_SRUN_FLAGS", ""))
        return cmd + argv
    return list(argv)


def run_ranks(cmd: list[str], env: dict) -> int:
    """Run the launcher command, forwarding SIGUSR1/SIGTERM/SIGINT to it; its exit code."""
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        raise LaunchError(f"cannot start {cmd[0]}: {exc}") from None

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - forwarded above
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return rc if rc >= 0 else 128 - rc


def rank_argv(job_json: str, run_dir: str, resume: bool) -> list[str]:
    """The per-rank command (``python -m hpcpar.run.trainer``)."""
    return [sys.executable, "-m", "hpcpar.run.trainer", job_json, "--run-dir", run_dir,
            "--resume" if resume else "--no-resume"]
