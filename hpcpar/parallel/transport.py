"""The halo transport: which library moves a run's halo faces and spatial collectives.

``[train] halo_transport`` names it: ``"mpi"`` (mpi4py; CUDA tensors passed directly, which
needs a CUDA-aware MPI), ``"staged"`` (mpi4py, CUDA tensors copied through pinned host
memory), ``"nccl"`` (a torch.distributed NCCL group, CUDA tensors), ``"gloo"`` (the same
torch.distributed code with a Gloo group, CPU tensors: it runs in the test suite) and
``"auto"``: on CUDA, NCCL when torch has it and no two spatial ranks share a GPU (NCCL
refuses that), else the MPI directly when it is CUDA-aware, else staging; on CPU, MPI.

:func:`use_transport` makes the choice for a grid (collective) and binds a torch.distributed
group, bootstrapped over MPI (:mod:`.torchdist`), to the grid's spatial communicator. The
messaging functions of :mod:`.comm` ask :func:`torch_group` for the group bound to their
communicator and move tensors of its device through it; everything else stays on MPI. So the
spatial collectives (norms, reductions, gathers) change transport without a line of their
own changing; the halo exchange and the boundary convolution post their messages through
:func:`exchange`, which groups them as NCCL needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hpcpar.errors import ConfigError
from hpcpar.parallel.comm import alltoallv, irecv, isend
from hpcpar.parallel.cuda_aware import cuda_aware, forced_cuda_path
from hpcpar.parallel.replay import count_sent
from hpcpar.parallel.torch_groups import TorchGroup, bind, torch_group, unbind
from hpcpar.parallel.torchdist import device_ident, process_group, shared_devices

if TYPE_CHECKING:
    from mpi4py import MPI

    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["TRANSPORTS", "resolve_transport", "exchange", "line_alltoallv", "HaloTransport",
           "use_transport", "torch_group"]

#: the values of ``[train] halo_transport``
TRANSPORTS = ("auto", "mpi", "nccl", "gloo", "staged")

_KEY = "[train] halo_transport"


def resolve_transport(name: str, device_type: str, *, nccl_available: bool, aware: bool,
                      shared_gpu: bool = False) -> str:
    """The transport ``name`` means for tensors on ``device_type`` (anything not ``"cuda"`` is
    host memory): ``"mpi"``, ``"staged"``, ``"nccl"`` or ``"gloo"``; on CPU ``"staged"`` is
    ``"mpi"`` (nothing to stage). ``aware``: the MPI takes CUDA memory; ``shared_gpu``: two
    ranks of a spatial group share one GPU. ConfigError (one line): an unknown name, or one
    that cannot move this device's tensors.
    """
    if name not in TRANSPORTS:
        raise ConfigError(f"{_KEY} = {name!r}, expected one of "
                          f"{', '.join(repr(t) for t in TRANSPORTS)}")
    cuda = device_type == "cuda"
    if name == "auto":
        # not NCCL yet: its halo path has not run on a device (benchmarks/device_check.sh
        # runs tests/gpu/test_transport_gpu.py); until a device session shows it exact and
        # faster, a GPU run takes it only when named
        if not cuda:
            return "mpi"
        return "mpi" if aware else "staged"
    if name == "nccl":
        if not cuda:
            raise ConfigError(f"{_KEY} = 'nccl' moves CUDA tensors, but this run is on "
                              f"{device_type}; use 'gloo', 'mpi' or 'auto'")
        if not nccl_available:
            raise ConfigError(f"{_KEY} = 'nccl' but this torch build has no NCCL; use "
                              f"'staged', 'mpi' or 'auto'")
    if name == "gloo" and cuda:
        raise ConfigError(f"{_KEY} = 'gloo' moves CPU tensors, but this run is on CUDA; use "
                          f"'nccl', 'mpi', 'staged' or 'auto'")
    if name == "mpi" and cuda and not aware:
        raise ConfigError(f"{_KEY} = 'mpi' passes CUDA memory to MPI, which is not "
                          f"CUDA-aware here; use 'staged', 'nccl' or 'auto'")
    return "mpi" if name == "staged" and not cuda else name


def exchange(comm: MPI.Comm, recvs: Sequence[tuple], sends: Sequence[tuple]) -> list:
    """Start point-to-point messages with neighbours: ``recvs`` and ``sends`` are
    ``(dense tensor, peer, tag)``; returns handles to ``wait()`` on (a send's tensor must not
    change, nor a receive's be read, before then). Through the group bound to ``comm``, else
    MPI (receives posted first)."""
    like = (recvs or sends)[0][0] if (recvs or sends) else None
    group = torch_group(comm, like) if like is not None else None
    if group is not None:
        for t, _, _ in sends:
            count_sent(t.numel() * t.element_size())
        return group.post(recvs, sends)
    return [irecv(t, peer, comm, tag) for t, peer, tag in recvs] + \
        [isend(t, peer, comm, tag) for t, peer, tag in sends]


def line_alltoallv(send: torch.Tensor, send_rows: Sequence[int], line: MPI.Comm,
                   spatial: MPI.Comm, recv_rows: Sequence[int]) -> torch.Tensor:
    """:func:`.comm.alltoallv` over ``line`` (an axis line of ``spatial``, ranks in coordinate
    order), for an op that every rank of ``spatial`` runs at once on its own line. Through
    the group bound to ``spatial`` when there is one (the line's blocks placed at their
    spatial ranks, nothing to the others: one group serves every line), else MPI on ``line``.
    """
    group = torch_group(spatial, send)
    if group is None:
        return alltoallv(send, send_rows, line, recv_rows)
    key = int(line.py2f())   # the line lives as long as the grid, and so the binding
    if key not in group.lines:
        peers = line.Get_group().Translate_ranks(list(range(line.Get_size())),
                                                 spatial.Get_group())
        group.lines[key] = tuple(peers) if list(peers) == sorted(peers) else None
    peers = group.lines[key]
    if peers is None:  # blocks would be out of order: MPI keeps the line's
        return alltoallv(send, send_rows, line, recv_rows)
    sends, recvs = [0] * spatial.Get_size(), [0] * spatial.Get_size()
    for peer, s, r in zip(peers, send_rows, recv_rows):
        sends[peer], recvs[peer] = int(s), int(r)
    return alltoallv(send, sends, spatial, recvs)


@dataclass
class HaloTransport:
    """The transport a run uses (what ``meta.json`` records: ``name``, and ``asked``, the
    value the job gave) and how to stop using it."""

    name: str
    asked: str
    _close: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def close(self) -> None:
        """Unbind the group (collective shutdown) and restore the CUDA path; idempotent."""
        self._close.close()


def use_transport(grid: ProcessGrid, name: str, device: torch.device | str,
                  timeout: float = 600.0) -> HaloTransport:
    """Choose the halo transport for ``grid``'s spatial messages and start using it.

    Collective over ``grid.comm``; every rank gets the same choice or the same error
    (ConfigError: the name cannot move this run's tensors; CommError: the torch.distributed
    group over ``grid.spatial_comm`` could not be made). ``close()`` it when the run ends.
    """
    from mpi4py import MPI

    device = torch.device(device)
    cuda = device.type == "cuda"
    shared = False
    if cuda and name == "auto":
        mine = shared_devices(grid.spatial_comm.allgather(device_ident(device))) is not None
        shared = bool(grid.comm.allreduce(int(mine), op=MPI.MAX))
    try:
        chosen, error = resolve_transport(
            name, device.type, nccl_available=dist.is_available() and dist.is_nccl_available(),
            aware=bool(cuda_aware()) if cuda else False, shared_gpu=shared), None
    except ConfigError as exc:
        chosen, error = "", str(exc)
    said = grid.comm.allgather((chosen, error))
    errors = [e for _, e in said if e]
    if errors:
        raise ConfigError(errors[0])
    if len({c for c, _ in said}) > 1:
        raise ConfigError(f"{_KEY} = {name!r} chose differently on different ranks "
                          f"({', '.join(sorted({c for c, _ in said}))}); name one")
    transport = HaloTransport(chosen, name)
    if chosen in ("nccl", "gloo"):
        pg, store, release = process_group(grid.spatial_comm, chosen,
                                           device if cuda else None, timeout,
                                           what="halo_transport")
        comm = grid.spatial_comm
        bind(comm, TorchGroup(pg, chosen, device.type, store, release))
        transport._close.callback(release)
        transport._close.callback(unbind, comm)
    elif cuda:  # "mpi" (CUDA-aware: checked above) or "staged"
        transport._close.enter_context(forced_cuda_path(chosen == "mpi"))
    return transport
