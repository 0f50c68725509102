"""Facts a run records about where it ran: package versions, Slurm job, cores and threads per
host, the git state of the job file's repository (all plain Python, no MPI needed)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


#: allocator libraries a rank may have preloaded (:mod:`hpcpar.launch.allocator`)
ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def malloc_in_use() -> str:
    """The allocator mapped into this process: one of :data:`ALLOCATORS`, else ``system``."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "system"
    return next((a for a in ALLOCATORS if f"lib{a}" in maps), "system")


def package_versions() -> dict:
    """Versions of the stack, read from package metadata (nothing heavy is imported)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("hpcpar", "torch", "mpi4py", "numpy", "numba", "h5py", "mpich"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["malloc"] = malloc_in_use()
    try:
        from mpi4py import MPI

        out["mpi_library"] = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        out["mpi_standard"] = "{}.{}".format(*MPI.Get_version())
    except Exception:  # noqa: BLE001 - a missing MPI must not stop a record
        out["mpi_library"] = None
    return out


def slurm_facts(env: Mapping[str, str] | None = None) -> dict | None:
    """Slurm job id, node list and friends from ``env`` (default ``os.environ``); None outside
    Slurm."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return None
    keys = {"job_id": job, "node_list": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
            "job_name": env.get("SLURM_JOB_NAME"), "partition": env.get("SLURM_JOB_PARTITION"),
            "account": env.get("SLURM_JOB_ACCOUNT"), "ntasks": env.get("SLURM_NTASKS"),
            "num_nodes": env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"),
            "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
            "array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
            "restart_count": env.get("SLURM_RESTART_COUNT"),
            "cluster": env.get("SLURM_CLUSTER_NAME")}
    return {k: v for k, v in keys.items() if v is not None}


def _int_or_none(text) -> int | None:
    try:
        return int(str(text).split("(")[0].split(",")[0])  # "4(x2)" / "4,4" Slurm forms
    except (TypeError, ValueError):
        return None


def rank_machine_facts(env: Mapping[str, str] | None = None) -> dict:
    """What one rank sees of its node: host, CPUs it may run on, threads it computes with.

    ``cpus`` is this process's affinity set (``os.sched_getaffinity``; all logical CPUs
    where that is unavailable), ``cpu_count`` the node's logical CPUs, ``slurm_cpus`` Slurm's
    ``SLURM_CPUS_ON_NODE`` (the CPUs the job holds on the node), ``threads`` torch's intra-op
    threads when torch is loaded, else ``OMP_NUM_THREADS`` (of ``env``, default ``os.environ``),
    else None (unknown).
    """
    env = os.environ if env is None else env
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    torch = sys.modules.get("torch")
    threads = None
    if torch is not None and hasattr(torch, "get_num_threads"):
        threads = int(torch.get_num_threads())
    elif env.get("OMP_NUM_THREADS"):
        threads = _int_or_none(env["OMP_NUM_THREADS"])
    return {"host": socket.gethostname(), "cpus": cpus, "cpu_count": os.cpu_count(),
            "slurm_cpus": _int_or_none(env.get("SLURM_CPUS_ON_NODE")), "threads": threads}


def machine_facts(per_rank: Sequence[dict]) -> dict:
    """Cores per node, ranks per node and threads per rank from every rank's
    :func:`rank_machine_facts` (``comm.allgather(rank_machine_facts())``), and whether the run
    was oversubscribed: ``{cores_per_node, cores_source, ranks_per_node, threads_per_rank,
    oversubscribed, hosts}``.

    cores of a node = Slurm's CPUs on the node when set, else the union of its ranks' affinity
    sets (what the ranks could use). cores_per_node, ranks_per_node and threads_per_rank are the
    values of the most crowded node (where the ratio ranks x threads / cores is largest);
    oversubscribed = ranks x threads > cores on any node (None when the threads are unknown).
    """
    hosts: dict = {}
    for f in per_rank:
        h = hosts.setdefault(f["host"], {"ranks": 0, "cpus": set(), "slurm": None,
                                         "threads": []})
        h["ranks"] += 1
        h["cpus"].update(f.get("cpus") or [])
        h["slurm"] = f.get("slurm_cpus") or h["slurm"]
        h["threads"].append(f.get("threads"))
    out_hosts, worst, source = {}, None, "affinity"
    for name, h in sorted(hosts.items()):
        cores = h["slurm"] or len(h["cpus"]) or None
        source = "SLURM_CPUS_ON_NODE" if h["slurm"] else source
        known = [t for t in h["threads"] if t is not None]
        threads = max(known) if len(known) == len(h["threads"]) and known else None
        out_hosts[name] = {"ranks": h["ranks"], "cores": cores, "threads": threads}
        load = h["ranks"] * (threads or 1) / (cores or 1)
        if worst is None or load > worst[0]:
            worst = (load, name)
    w = out_hosts[worst[1]] if worst else {"ranks": None, "cores": None, "threads": None}
    over = [h["ranks"] * h["threads"] > h["cores"] for h in out_hosts.values()
            if h["threads"] is not None and h["cores"]]
    return {"cores_per_node": w["cores"], "cores_source": source,
            "ranks_per_node": w["ranks"], "threads_per_rank": w["threads"],
            "oversubscribed": any(over) if len(over) == len(out_hosts) or any(over) else None,
            "hosts": out_hosts}


def host_load() -> list | None:
    """The host's 1, 5 and 15-minute load averages (runnable processes, ``os.getloadavg``)
    rounded to 0.01, None where the OS has none: a busy host makes every step time, and so every
    speedup, suspect."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def git_facts(path: str | os.PathLike | None) -> dict | None:
    """Commit, dirtiness and root of the git repository holding a file or directory (the job
    file); None outside a repository (or without git)."""
    if not path:
        return None
    where = Path(path).resolve()
    where = where if where.is_dir() else where.parent
    if not where.exists():
        return None

    def git(*args):
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        root = git("rev-parse", "--show-toplevel")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty, "root": root}
