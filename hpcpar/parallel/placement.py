"""Where this rank sits: rank, local rank and sizes from the launcher's environment (Slurm,
Open MPI, MPICH/hydra, PALS), and the GPU a rank takes (one per local rank).

Read from the environment alone, before MPI is initialised, so the launcher can use it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, overload

if TYPE_CHECKING:
    import torch

__all__ = ["env_int", "in_slurm_step", "rank_info", "select_device"]


class RankInfo(NamedTuple):
    """Where a rank sits, as the launcher tells it: world ``rank`` of ``size``, ``local_rank``
    of ``local_size`` on its node."""

    rank: int
    local_rank: int
    size: int
    local_size: int


@overload
def env_int(env: Mapping[str, str], names: Sequence[str], default: int) -> int: ...


@overload
def env_int(env: Mapping[str, str], names: Sequence[str],
            default: int | None = None) -> int | None: ...


def env_int(env: Mapping[str, str], names: Sequence[str],
            default: int | None = None) -> int | None:
    """The integer held by the first of ``names`` (in order of preference) that holds one,
    else ``default``."""
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                continue
    return default


def in_slurm_step(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a task of a Slurm job step (started by ``srun``), not the batch
    script itself. ``env``: ``os.environ`` when None."""
    env = os.environ if env is None else env
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return step not in (None, "", "batch", "extern", "4294967294", "4294967291")


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """Rank, local rank and sizes from the launcher's variables, before MPI starts.

    Slurm (``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``, inside a step) first, then
    Open MPI, PMI/PMIx (MPICH/hydra) and PALS; rank 0 of 1 when no launcher variable is set.
    ``env``: ``os.environ`` when None.
    """
    env = os.environ if env is None else env
    slurm = in_slurm_step(env)
    rank = env_int(env, (["SLURM_PROCID"] if slurm else []) +
                      ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"], 0)
    local = env_int(env, (["SLURM_LOCALID"] if slurm else []) +
                       ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID"], 0)
    size = env_int(env, (["SLURM_NTASKS"] if slurm else []) +
                      ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"], 1)
    local_size = env_int(env, (["SLURM_NTASKS_PER_NODE"] if slurm else []) +
                            ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"], 1)
    return RankInfo(rank, local, size, local_size)


def select_device(info: RankInfo | None = None) -> torch.device:
    """The device this rank computes on, made current: one GPU per local rank (``info``:
    ``rank_info()`` when None). ``cuda:<local rank mod visible GPUs>`` when CUDA exists
    (``cuda:0`` when the launcher already restricted each rank to one GPU), else ``cpu``."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    info = info or rank_info()
    idx = info.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)
