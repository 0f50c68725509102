"""torch.distributed process groups (NCCL on CUDA, Gloo on CPU) bootstrapped from MPI.

Two users: gradient buckets reduced by NCCL instead of MPI (``[train] grad_sync``,
:mod:`hpcpar.sync._torchdist`), and the halo exchange and spatial collectives of a
``[train] halo_transport`` of ``"nccl"`` or ``"gloo"`` (:mod:`.transport`). The user sets no
rendezvous variables: the MPI communicator already connects the ranks, so rank 0 opens a
``TCPStore`` on a free port of its host (port 0: the kernel picks one, no race), broadcasts
address and port over MPI, and the other ranks connect to it. On one host the address is
127.0.0.1; across hosts it is rank 0's first non-loopback address.

The group object is made directly (``ProcessGroupNCCL(store, rank, size)``), not through
``init_process_group``: no global default group, so several groups (world, data axis) and
several models can coexist, and user code that does its own ``init_process_group`` is left
alone. Gloo makes the same group on CPU, which tests the bootstrap without a GPU.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from hpcpar.errors import CommError
from hpcpar.parallel.buffers import free_at_exit

__all__ = ["shared_devices", "device_ident", "rendezvous_host", "process_group", "TorchWork"]

def shared_devices(idents: list) -> tuple[int, int] | None:
    """The first two ranks whose GPU identity (``idents``: host and device UUID per rank) is
    the same, or None when every rank has its own GPU (NCCL refuses such a group)."""
    seen: dict = {}
    for rank, ident in enumerate(idents):
        if ident in seen:
            return seen[ident], rank
        seen[ident] = rank
    return None


def device_ident(device: torch.device) -> tuple:
    """This rank's GPU as (host, device UUID): equal on two ranks sharing one GPU."""
    props = torch.cuda.get_device_properties(device)
    return socket.gethostname(), str(getattr(props, "uuid", device.index))


def rendezvous_host(hostnames: list[str]) -> str:
    """Address the other ranks reach rank 0's store at: 127.0.0.1 when every rank is on
    rank 0's host, else rank 0's first non-loopback address (its hostname if none).
    ``hostnames``: ``socket.gethostname()`` of every rank, in rank order."""
    if all(h == hostnames[0] for h in hostnames):
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(hostnames[0], None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return hostnames[0]
    for info in infos:
        address = str(info[4][0])  # AF_INET: (host, port)
        if not address.startswith("127."):
            return address
    return hostnames[0]


def process_group(comm, backend: str, device: torch.device | None = None,
                  timeout: float = 600.0, what: str = "grad_sync"):
    """A torch.distributed process group over the ranks of the MPI communicator ``comm``.

    Collective over ``comm``. Errors (no free port, NCCL ranks sharing a GPU) are raised on
    every rank alike, not left to hang the others: CommError when the store could not be
    opened or reached, or two ranks share one GPU under NCCL (``device``: NCCL only).
    ``timeout``: seconds a collective may take before torch fails it; ``what``: the setting
    that asked (``grad_sync``, ``halo_transport``), named in errors.

    Returns ``(group, store, release)``: the ``ProcessGroupNCCL`` or ``ProcessGroupGloo``, its
    ``TCPStore``, which must live as long as the group, and the collective call that shuts
    the group down (else done at exit).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if backend == "nccl":
        assert device is not None, f"{what}='nccl' needs this rank's CUDA device"
        pair = shared_devices(comm.allgather(device_ident(device)))
        if pair is not None:
            raise CommError(f"{what}='nccl': ranks {pair[0]} and {pair[1]} share one GPU "
                            f"({device}); NCCL needs a GPU per rank (use {what}='mpi' "
                            f"or fewer ranks per GPU)")
    host = rendezvous_host(comm.allgather(socket.gethostname()))
    wait = datetime.timedelta(seconds=timeout)
    store: dist.TCPStore | None = None
    where: tuple[str, int, str | None] | None = None
    if rank == 0:
        try:
            store = dist.TCPStore(host, 0, size, is_master=True, timeout=wait,
                                  wait_for_workers=False)
            where = (host, int(store.port), None)
        except Exception as exc:  # noqa: BLE001 - told to every rank below
            where = (host, 0, f"{type(exc).__name__}: {exc}")
    host, port, error = comm.bcast(where, root=0)
    if error is not None:
        raise CommError(f"{what}={backend!r}: rank 0 could not open its rendezvous store "
                        f"on {host}: {error}")
    failed = None
    if rank != 0:
        try:
            store = dist.TCPStore(host, port, size, is_master=False, timeout=wait)
        except Exception as exc:  # noqa: BLE001
            failed = f"{type(exc).__name__}: {exc}"
    failures = comm.allgather(failed)
    bad = [r for r, f in enumerate(failures) if f]
    if bad:
        raise CommError(f"{what}={backend!r}: rank(s) {bad} could not reach rank 0's "
                        f"rendezvous store at {host}:{port}: {failures[bad[0]]}")
    assert store is not None  # opened on every rank, or CommError above
    pg: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
    if backend == "nccl":
        # torch's stub lists `options` as required; the binding defaults it
        pg = dist.ProcessGroupNCCL(store, rank, size)  # type: ignore[call-arg]
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, wait)
    shutdown = getattr(pg, "shutdown", None) or getattr(pg, "_shutdown", None)
    release = free_at_exit(shutdown) if shutdown is not None else lambda: None
    return pg, store, release


class TorchWork:
    """A torch.distributed ``Work`` with the two calls a bucket pipeline makes on an MPI
    request: ``Test()`` (non-blocking) and ``Wait()`` (for NCCL: the current stream waits for
    the reduction, the host does not)."""

    __slots__ = ("work",)
    blocking_wait = True  # Pending.wait may call Wait() (it does not spin like MPI's)

    def __init__(self, work):
        self.work = work

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling
        return bool(self.work.is_completed())

    def Wait(self) -> None:  # noqa: N802
        self.work.wait()
