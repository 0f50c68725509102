"""Starting the ranks: ``mpiexec`` on a workstation, ``srun`` inside a Slurm allocation, nothing
when already running under MPI.

:func:`plan_launch` decides from the environment alone (no MPI import in the launcher):

* already under MPI with more than one rank (``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE`` or a Slurm
  step with ``SLURM_NTASKS`` > 1): run in this process (``direct``);
* inside an allocation (``SLURM_JOB_ID`` set) but not in a job step: ``srun`` with explicit
  ``--cpus-per-task`` (Slurm >= 22.05 no longer passes it on), ``--kill-on-bad-exit`` and
  ``--mpi=pmi2`` for the pip ``mpich`` wheel (with its OFI netmod: :data:`WHEEL_SRUN_ENV`);
  extra flags from ``HPCPAR_SRUN_FLAGS``;
* otherwise ``mpiexec -n N`` (:func:`hpcpar.launch.mpiexec.find_mpiexec`), or in-process for N = 1;
  the ``mpich`` wheel's ``mpiexec`` (hydra) keeps such a local run on the loopback interface
  (:func:`loopback_flags`).

``HPCPAR_LAUNCH=direct|srun|mpiexec`` forces a mode. Ranks read their place from
:func:`hpcpar.parallel.placement.rank_info` and take one GPU per local rank."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from contextlib import suppress
from importlib import metadata
from typing import Any

from hpcpar import _env
from hpcpar.errors import EXIT_ABORTED, LaunchError
from hpcpar.launch.mpiexec import find_mpiexec
from hpcpar.parallel.placement import env_int, in_slurm_step

__all__ = ["MODES", "WHEEL_SRUN_ENV", "LOOPBACK_ENV", "wheel_srun_export", "mpi_world_size",
           "default_ranks", "plan_launch", "launch_command", "run_ranks", "rank_argv"]

MODES = ("direct", "srun", "mpiexec")

#: What ranks of the pip ``mpich`` wheel need under ``srun --mpi=pmi2``. Its default UCX
#: netmod publishes a fixed 4 KiB address buffer (the real address plus whatever memory follows
#: it) through Slurm's PMI-1 wire once the ranks span nodes; a segment of that buffer that does
#: not compress overflows Slurm's 1 KiB request line ("mpi/pmi2: value not properly
#: terminated") and the job hangs in ``MPI_Init``, depending on the process's memory layout.
#: The OFI netmod publishes only its real (short) address. Of its providers, the default
#: ``sockets`` (deprecated in libfabric) hung in ``MPI_Init`` in about 1 of 20 starts of 8
#: ranks on 4 nodes; ``tcp`` (with ``ofi_rxm``) in none of 60. A value the user set wins.
WHEEL_SRUN_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}

#: What keeps the ranks of a local run of the ``mpich`` wheel listening on 127.0.0.1 only
#: instead of every interface: its UCX netmod (the default) and OFI's ``tcp`` provider each take
#: the interface from these. A value the user set wins.
LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo"}

#: Variables under which hydra starts ranks on other hosts (a host file, an allocation).
_HYDRA_REMOTE = ("HYDRA_HOST_FILE", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


def mpi_world_size(env: Mapping[str, str] | None = None) -> int:
    """Ranks of the MPI job this process already belongs to (1 when not launched by MPI); ``env``
    defaults to ``os.environ``, here and below."""
    env = os.environ if env is None else env
    if in_slurm_step(env):
        return env_int(env, ["SLURM_NTASKS", "PMI_SIZE"], 1)
    return env_int(env, ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"], 1)


def default_ranks(env: Mapping[str, str] | None = None) -> int | None:
    """The rank count implied by the environment: an MPI world or a Slurm allocation's tasks; None
    when it implies none."""
    env = os.environ if env is None else env
    world = mpi_world_size(env)
    if world > 1:
        return world
    if env.get("SLURM_JOB_ID") and not in_slurm_step(env):
        return env_int(env, ["SLURM_NTASKS"], None)
    return None


def plan_launch(n: int, env: Mapping[str, str] | None = None) -> str:
    """How to start ``n`` ranks here: ``"direct"``, ``"srun"`` or ``"mpiexec"`` by the rules of the
    module docstring. :class:`LaunchError` when already under MPI with another rank count."""
    env = os.environ if env is None else env
    forced = _env.get("HPCPAR_LAUNCH", env)
    if forced:
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
    try:
        metadata.version("mpich")
        return True
    except metadata.PackageNotFoundError:
        return False


def wheel_srun_export(env: Mapping[str, str], flags: Sequence[str] = ()) -> list[str]:
    """``srun --export=ALL,...`` with :data:`WHEEL_SRUN_ENV` for what ``env`` does not set: zero or
    one flag (none when ``flags`` already choose an ``--export``)."""
    add = [f"{k}={v}" for k, v in WHEEL_SRUN_ENV.items() if k not in env]
    if not add or any(f.startswith("--export") for f in flags):
        return []
    return ["--export=" + ",".join(["ALL", *add])]


def loopback_flags(mpiexec: str, env: Mapping[str, str]) -> list[str]:
    """``mpiexec`` flags that keep a local run off the network, where the MPI allows it: only for
    the ``mpich`` wheel's hydra (the ``mpiexec`` beside this Python) starting every rank on this
    host (no host file, no batch allocation), ``-iface lo`` (hydra's proxies reach ``mpiexec`` over
    loopback) and :data:`LOOPBACK_ENV` for the ranks through ``-genv``; none otherwise. Hydra's own
    control port still listens on every interface: MPICH 5.0 has no option to bind it."""
    beside = {os.path.abspath(d) for d in (sysconfig.get_path("scripts"),
                                           os.path.dirname(sys.executable))}
    if os.path.dirname(os.path.abspath(mpiexec)) not in beside or not _uses_mpich_wheel() \
            or any(env.get(k) for k in _HYDRA_REMOTE):
        return []
    flags = ["-iface", "lo"]
    for name, value in LOOPBACK_ENV.items():
        if name not in env:
            flags += ["-genv", name, value]
    return flags


def launch_command(mode: str, n: int, argv: list[str], *, cpus_per_task: int = 1,
                   gpus_per_node: int = 0, env: Mapping[str, str] | None = None) -> list[str]:
    """The full command line that starts the per-rank ``argv`` on ``n`` ranks in ``mode`` (from
    ``plan_launch``; ``argv`` itself for ``"direct"``). With ``srun``, the allocation's
    ``SLURM_CPUS_PER_TASK`` wins over ``cpus_per_task``, and each task gets one GPU when
    ``gpus_per_node``; ``mpiexec`` mode without an ``mpiexec`` raises :class:`LaunchError`."""
    env = os.environ if env is None else env
    if mode == "mpiexec":
        mpiexec = find_mpiexec()
        return [mpiexec, *loopback_flags(mpiexec, env), "-n", str(n), *argv]
    if mode == "srun":
        cpt = env_int(env, ["SLURM_CPUS_PER_TASK"], cpus_per_task)
        cmd = ["srun", f"--ntasks={n}", f"--cpus-per-task={cpt}", "--kill-on-bad-exit=1"]
        mpi = _env.get("HPCPAR_SRUN_MPI", env)
        if mpi is None:
            mpi = "pmi2" if _uses_mpich_wheel() else ""
        if mpi:
            cmd.append(f"--mpi={mpi}")
        flags = _env.get("HPCPAR_SRUN_FLAGS", env)
        if mpi == "pmi2" and _uses_mpich_wheel():
            cmd += wheel_srun_export(env, flags)
        if gpus_per_node and not any(f.startswith("--gpus") for f in flags):
            cmd.append("--gpus-per-task=1")
        cmd += flags
        return cmd + argv
    return list(argv)


def _child_setup() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The launcher gets its own process group (a terminal's Ctrl-C reaches only ``hpcpar
    run``, which forwards it exactly once) and dies with ``hpcpar run`` (Linux
    ``PR_SET_PDEATHSIG``), taking its ranks along, so nothing outlives a killed CLI."""
    os.setpgid(0, 0)
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG


def run_ranks(cmd: list[str], env: dict) -> int:
    """Run the launcher command with the ranks' ``env``, forwarding SIGUSR1/SIGTERM/SIGINT to it;
    its exit code (128 + the signal number when a signal killed it), or :class:`LaunchError` when it
    cannot start.

    Ctrl-C: the first SIGINT is forwarded (as SIGTERM to ``srun``, which would only print its status
    on a single SIGINT): the ranks checkpoint and exit 3. A second one kills the launcher and its
    ranks at once: ``EXIT_ABORTED`` (130). The launcher runs in its own process group, so a
    terminal's Ctrl-C reaches it only through this forwarding, once."""
    state: dict[str, Any] = {"proc": None, "interrupted": False, "aborted": False}
    as_term = os.path.basename(cmd[0]) == "srun"

    def forward(signum, frame):
        proc = state["proc"]
        if signum == signal.SIGINT:
            if state["interrupted"]:
                if proc is not None and proc.poll() is None:
                    state["aborted"] = True
                    proc.kill()
                return
            state["interrupted"] = True
            if as_term:
                signum = signal.SIGTERM
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            state["proc"] = proc = subprocess.Popen(cmd, env=env, preexec_fn=_child_setup)
        except OSError as exc:
            raise LaunchError(f"cannot start {cmd[0]}: {exc}") from None
        if state["interrupted"]:              # Ctrl-C while starting: forward it now
            proc.send_signal(signal.SIGTERM if as_term else signal.SIGINT)
        rc = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if state["aborted"]:
        return EXIT_ABORTED
    return rc if rc >= 0 else 128 - rc


def rank_argv(job_json: str, run_dir: str, resume: bool) -> list[str]:
    """The per-rank command (``python -m hpcpar.run.trainer``) for the resolved job file
    (``RUN/job.json``)."""
    return [sys.executable, "-m", "hpcpar.run.trainer", job_json, "--run-dir", run_dir,
            "--resume" if resume else "--no-resume"]
