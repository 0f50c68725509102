"""Where this rank sits: rank, local rank and sizes from the launcher's environment (Slurm,
Open MPI, MPICH/hydra, PALS), and the GPU a rank takes (one per local rank).

Read from the environment alone, before MPI is initialised, so the launcher can use it too.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class RankInfo(NamedTuple):
    rank: int
    local_rank: int
    size: int
    local_size: int


def env_int(env, names, default=None):
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                continue
    return default


def in_slurm_step(env=None) -> bool:
    env = os.environ if env is None else env
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return step not in (None, "", "batch", "extern", "4294967294", "4294967291")


def rank_info(env=None) -> RankInfo:
    """Rank, local rank and sizes from Slurm, Open MPI or PMI (MPICH/hydra) variables."""
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


def select_device(info: RankInfo | None = None):
    """``cuda:<local rank mod visible GPUs>`` when CUDA exists (one GPU per local rank;
    ``cuda:0`` when the launcher already restricted each rank to one), else ``cpu``."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    info = info or rank_info()
    idx = info.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)
