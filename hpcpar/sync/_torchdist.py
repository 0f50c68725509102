"""``grad_sync``: which torch.distributed backend reduces gradient buckets (NCCL for GPU
gradients, Gloo on CPU for tests), on process groups bootstrapped from MPI by
:mod:`hpcpar.parallel.torchdist` (re-exported here: the halo transport shares the bootstrap).
Everything else (model checks, the stall detector) stays on MPI.
"""

from __future__ import annotations

import torch.distributed as dist

from hpcpar.errors import ConfigError
from hpcpar.parallel.torchdist import TorchWork, process_group, rendezvous_host, shared_devices

__all__ = ["GRAD_SYNC", "check_grad_sync", "shared_devices", "rendezvous_host",
           "process_group", "TorchWork"]

#: accepted ``grad_sync`` values -> torch.distributed backend (None: MPI)
GRAD_SYNC = {"mpi": None, "nccl": "nccl", "gloo": "gloo"}


def check_grad_sync(grad_sync: str, devices: set) -> str | None:
    """The torch.distributed backend for ``grad_sync`` (None for MPI) on trained parameters
    of the device types ``devices``. ConfigError: an unknown value, or NCCL for parameters not
    all on CUDA or with a torch that has no NCCL."""
    if grad_sync not in GRAD_SYNC:
        raise ConfigError(f"DistributedDataParallel: grad_sync={grad_sync!r}, expected "
                          f"'mpi' or 'nccl'")
    backend = GRAD_SYNC[grad_sync]
    if backend == "nccl":
        where = ", ".join(sorted(devices)) or "no parameters"
        if devices != {"cuda"}:
            raise ConfigError(f"DistributedDataParallel: grad_sync='nccl' needs the model on a "
                              f"CUDA device (its parameters are on {where}); use "
                              f"grad_sync='mpi'")
        if not (dist.is_available() and dist.is_nccl_available()):
            raise ConfigError("DistributedDataParallel: grad_sync='nccl' but this torch "
                              "build has no NCCL; use grad_sync='mpi'")
    return backend
