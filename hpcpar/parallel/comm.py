"""Moving torch tensors through MPI: reductions, broadcasts, point-to-point, gathers,
reduce-scatter and all-to-all on tensors.

A tensor becomes an MPI message through :mod:`.buffers` (CPU zero-copy; CUDA directly when the
MPI library is CUDA-aware, :mod:`.cuda_aware` decides, else through a reusable pinned host
buffer). Either way the host first waits for the work queued on the current stream up to the
message (``device_ready``: an event, never the whole device): mpi4py does no stream
synchronisation. Their names are re-exported here, the module users import for messaging.

MPI has no portable 16-bit float type, and ``__cuda_array_interface__`` may mislabel bf16 as
fp16: float16/bfloat16 travel as 16-bit integers, and reductions on them run in float32.
Booleans travel as bytes; a SUM over booleans is a logical OR (torch's own rule for bool).

A communicator bound to a torch.distributed group (the run's ``halo_transport``, see
:mod:`.transport`) moves the tensors of that group's device through it instead, with the
same conventions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from hpcpar.errors import CommError
from hpcpar.parallel.buffers import (
    STAGING,
    SUPPORTED,
    Buffer,
    as_buffer,
    free_at_exit,
    message_buffer,
    wire_dtype,
)
from hpcpar.parallel.cuda_aware import (
    CudaAwareness,
    Synchronizable,
    cuda_aware,
    detect_cuda_aware,
    device_ready,
    forced_cuda_path,
)
from hpcpar.parallel.replay import count_sent, taped
from hpcpar.parallel.torch_groups import torch_group

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["SUPPORTED", "CudaAwareness", "detect_cuda_aware", "cuda_aware", "forced_cuda_path",
           "device_ready", "Synchronizable", "STAGING",
           "wire_dtype", "Buffer", "free_at_exit", "message_buffer", "as_buffer", "Handle",
           "iallreduce", "allreduce_", "sum_grads_", "bcast_", "isend", "irecv",
           "sendrecv", "allgather", "allgatherv", "reduce_scatter", "alltoallv", "check_same"]

_HALF = (torch.float16, torch.bfloat16)


def _mpi_op(op: str | MPI.Op | None) -> MPI.Op:
    from mpi4py import MPI

    if op is None:
        return MPI.SUM
    if isinstance(op, str):
        names = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
        if op.lower() not in names:
            raise CommError(f"unknown reduction {op!r}, expected one of {', '.join(names)}")
        return names[op.lower()]
    return op


def _bool_op(op: MPI.Op) -> MPI.Op:
    """Logical reductions on bytes: SUM/MAX -> OR (as MAX), PROD/MIN -> AND (as MIN)."""
    from mpi4py import MPI

    return MPI.MAX if op in (MPI.SUM, MPI.MAX, MPI.LOR, MPI.BOR) else MPI.MIN


class Handle:
    """A pending non-blocking operation on tensors; ``wait()`` completes it, finishes
    ``buffers``, calls ``after`` once, and returns ``result`` (16-bit results are converted back
    from their fp32 accumulator)."""

    def __init__(self, request: MPI.Request, buffers: list[Buffer],
                 after: Callable[[], object] | None = None,
                 result: torch.Tensor | None = None):
        self.request = request
        self.buffers = buffers
        self.after = after
        self.result = result
        self.done = False

    def test(self) -> bool:
        """True once the operation has completed (``wait()`` then returns at once)."""
        return self.done or bool(self.request.Test())

    def wait(self) -> torch.Tensor | None:
        """Complete the operation, copy staged bytes back, and return the result tensor."""
        if not self.done:
            self.request.Wait()
            for b in self.buffers:
                b.finish()
            if self.after is not None:
                self.after()
            self.done = True
        return self.result


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous (a copy queued on the current stream, after ``t``'s producer: no wait
    here; the MPI buffer waits for the copy)."""
    return t if t.is_contiguous() else t.contiguous()


def _reduce_target(t: torch.Tensor):
    """(tensor to reduce in, copy-back function) — fp32 scratch for 16-bit types."""
    if t.dtype in _HALF:
        acc = t.float()  # queued after t's producer on the current stream: no wait here
        return acc, (lambda: t.copy_(acc))
    return t, None


def _reduce_in_place(t: torch.Tensor, op: str | MPI.Op | None) -> tuple[Buffer, MPI.Op,
                                                                         Callable | None]:
    """(MPI buffer, MPI op, copy-back function or None) to reduce ``t`` in place: 16-bit
    types in an fp32 scratch copy, bool as logical OR/AND."""
    mpi_op = _mpi_op(op)
    target, back = _reduce_target(t)
    if target.dtype == torch.bool:
        mpi_op = _bool_op(mpi_op)
    return as_buffer(target), mpi_op, back


def iallreduce(t: torch.Tensor, comm: MPI.Comm, op: str | MPI.Op = "sum") -> Handle:
    """Start an in-place allreduce of ``t`` over ``comm``; the Handle's ``wait()`` returns ``t``.

    ``op`` is ``"sum"``, ``"max"``, ``"min"``, ``"prod"`` or an ``MPI.Op`` (else CommError).
    16-bit tensors reduce in a float32 scratch copy; bool tensors as OR/AND.
    """
    from mpi4py import MPI

    buf, op, back = _reduce_in_place(t, op)
    req = comm.Iallreduce(MPI.IN_PLACE, buf.mpi, op=op)
    return Handle(req, [buf], after=back, result=t)


@taped("allreduce_", in_place=True)
def allreduce_(t: torch.Tensor, comm: MPI.Comm, op: str | MPI.Op = "sum") -> torch.Tensor:
    """Allreduce ``t`` over ``comm`` in place and return it (collective). ``op`` as in
    :func:`iallreduce` (else CommError); 16-bit tensors reduce in float32."""
    from mpi4py import MPI

    group = torch_group(comm, t)
    if group is not None:
        return group.allreduce_(t, op)
    buf, op, back = _reduce_in_place(t, op)
    comm.Allreduce(MPI.IN_PLACE, buf.mpi, op=op)
    buf.finish()
    if back is not None:
        back()
    return t


def sum_grads_(params: Iterable[torch.nn.Parameter], comm: MPI.Comm) -> None:
    """Sum the ``.grad`` of ``params`` over ``comm`` in place, in one message (replicated
    weights whose ranks each hold a partial gradient, as in full-graph GNN training).
    Collective, the same list on every rank; a no-op on one rank."""
    params = list(params)
    if comm.Get_size() == 1:
        return
    grads = []
    for p in params:
        assert p.grad is not None, "sum_grads_: a parameter without a gradient"
        grads.append(p.grad)
    flat = allreduce_(torch.cat([g.reshape(-1) for g in grads]), comm)
    off = 0
    for p, g in zip(params, grads):
        g.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()


def bcast_(t: torch.Tensor, comm: MPI.Comm, root: int = 0) -> torch.Tensor:
    """Broadcast ``t`` (same shape and dtype on every rank) from rank ``root`` of ``comm`` in
    place and return it."""
    group = torch_group(comm, t)
    if group is not None:
        return group.broadcast_(t, root)
    buf = as_buffer(t)
    comm.Bcast(buf.mpi, root=root)
    buf.finish()
    return t


def isend(t: torch.Tensor, dest: int, comm: MPI.Comm, tag: int = 0) -> Handle:
    """Start sending ``t`` to rank ``dest`` of ``comm`` (``MPI.PROC_NULL``: a no-op); do not
    modify ``t`` before the Handle's ``wait()``, which returns ``t``."""
    count_sent(t.numel() * t.element_size())
    group = torch_group(comm, t)
    if group is not None:
        return group.post((), ((t, dest, tag),))[0]  # type: ignore[return-value]
    buf = as_buffer(t, copy_back=False)
    return Handle(comm.Isend(buf.mpi, dest=dest, tag=tag), [buf], result=t)


def irecv(t: torch.Tensor, source: int, comm: MPI.Comm, tag: int = 0) -> Handle:
    """Start receiving into ``t`` from rank ``source`` of ``comm`` (``MPI.PROC_NULL``: a
    no-op); ``t`` is valid after the Handle's ``wait()``, which returns it."""
    group = torch_group(comm, t)
    if group is not None:
        return group.post(((t, source, tag),), ())[0]  # type: ignore[return-value]
    buf = Buffer(t, True, copy_in=False)
    return Handle(comm.Irecv(buf.mpi, source=source, tag=tag), [buf], result=t)


def sendrecv(send: torch.Tensor, dest: int, recv: torch.Tensor, source: int, comm: MPI.Comm,
             sendtag: int = 0, recvtag: int | None = None) -> torch.Tensor:
    """Send ``send`` to ``dest`` while receiving into ``recv`` from ``source``; return ``recv``.

    ``MPI.PROC_NULL`` at a boundary sends or receives nothing; ``recvtag`` None is ``sendtag``.
    """
    group = torch_group(comm, send)
    if group is not None:
        if not recv.is_contiguous():
            raise CommError("MPI buffers must be contiguous tensors (call .contiguous())")
        tag = sendtag if recvtag is None else recvtag
        for h in group.post(((recv, source, tag),), ((_dense(send), dest, sendtag),)):
            h.wait()
        return recv
    sb = as_buffer(send, copy_back=False)
    rb = Buffer(recv, True, copy_in=False)
    comm.Sendrecv(sb.mpi, dest=dest, sendtag=sendtag, recvbuf=rb.mpi, source=source,
                  recvtag=sendtag if recvtag is None else recvtag)
    sb.finish()
    rb.finish()
    return recv


@taped("allgather")
def allgather(t: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """Gather one equal-shaped tensor from every rank onto every rank: shape
    ``(comm.size, *t.shape)``, rank r's tensor at index r."""
    size = comm.Get_size()
    out = torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
    group = torch_group(comm, t)
    if group is not None:
        return group.allgather(t, out)
    sb = as_buffer(_dense(t), copy_back=False)
    rb = Buffer(out, True, copy_in=False)
    comm.Allgather(sb.mpi, rb.mpi)
    sb.finish()
    rb.finish()
    return out


@taped("allgatherv")
def allgatherv(t: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """Every rank's rows of ``t`` (dim 0 may differ, trailing dims and dtype match)
    concatenated along dim 0 in rank order."""
    rows = comm.allgather(int(t.shape[0]))
    group = torch_group(comm, t)
    if group is not None:  # equal blocks: each rank's rows padded to the longest
        block = t.new_zeros((max(rows), *t.shape[1:]))
        block[:t.shape[0]] = t
        every = group.allgather(block, t.new_empty((len(rows), *block.shape)))
        return torch.cat([every[r, :n] for r, n in enumerate(rows)])
    inner = int(np.prod(t.shape[1:])) if t.dim() > 1 else 1
    out = torch.empty((sum(rows), *t.shape[1:]), dtype=t.dtype, device=t.device)
    sb = as_buffer(_dense(t), copy_back=False)
    rb = Buffer(out, True, copy_in=False)
    counts = [r * inner for r in rows]
    comm.Allgatherv(sb.mpi, [rb.mpi, counts])
    sb.finish()
    rb.finish()
    return out


def reduce_scatter(t: torch.Tensor, rows: Sequence[int], comm: MPI.Comm,
                   op: str | MPI.Op = "sum") -> torch.Tensor:
    """Reduce ``t`` (same shape on every rank; 16-bit in float32) over ``comm`` element-wise
    and return rank r's rows ``[off_r, off_r + rows[r])`` of the result in ``t``'s dtype.

    ``rows`` (uneven allowed) must give one count per rank summing to ``t.shape[0]``, else
    CommError. ``op`` as in :func:`iallreduce`.
    """
    rows = [int(r) for r in rows]
    if len(rows) != comm.Get_size() or sum(rows) != t.shape[0]:
        raise CommError(f"reduce_scatter: row counts {rows} do not split {t.shape[0]} rows "
                        f"over {comm.Get_size()} ranks")
    off = sum(rows[:comm.Get_rank()])
    group = torch_group(comm, t)
    if group is not None:  # the whole reduction, then this rank's rows (MPI's conventions)
        return group.allreduce_(t.clone(memory_format=torch.contiguous_format), op)[
            off:off + rows[comm.Get_rank()]].clone()
    src, _ = _reduce_target(_dense(t))
    inner = int(np.prod(t.shape[1:])) if t.dim() > 1 else 1
    out = torch.empty((rows[comm.Get_rank()], *t.shape[1:]), dtype=src.dtype, device=t.device)
    sb = as_buffer(src, copy_back=False)
    rb = Buffer(out, True, copy_in=False)
    comm.Reduce_scatter(sb.mpi, rb.mpi, [r * inner for r in rows], op=_mpi_op(op))
    sb.finish()
    rb.finish()
    return out.to(t.dtype)


@taped("alltoallv")
def alltoallv(send: torch.Tensor, send_rows: Sequence[int], comm: MPI.Comm,
              recv_rows: Sequence[int] | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Exchange row blocks: this rank sends ``send[off_r : off_r + send_rows[r]]`` to rank r
    and returns the received rows in source-rank order.

    ``send_rows`` must give one count per rank summing to ``send.shape[0]`` (else CommError);
    ``recv_rows`` None is exchanged (one small Alltoall). ``out``: receive into this contiguous
    tensor of the received rows (e.g. the tail of a larger one, saving a copy), returned.
    """
    size = comm.Get_size()
    send_rows = [int(r) for r in send_rows]
    if len(send_rows) != size:
        raise CommError(f"alltoallv: {len(send_rows)} send counts for {size} ranks")
    if sum(send_rows) != send.shape[0]:
        raise CommError(f"alltoallv: send counts sum to {sum(send_rows)}, "
                        f"tensor has {send.shape[0]} rows")
    if recv_rows is None:
        recv_rows = comm.alltoall(send_rows)
    recv_rows = [int(r) for r in recv_rows]
    inner = int(np.prod(send.shape[1:])) if send.dim() > 1 else 1
    shape = (sum(recv_rows), *send.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=send.dtype, device=send.device)
    elif tuple(out.shape) != shape or not out.is_contiguous() or out.dtype != send.dtype:
        raise CommError(f"alltoallv: out is {tuple(out.shape)} {out.dtype}, expected a "
                        f"contiguous {shape} {send.dtype}")
    group = torch_group(comm, send)
    if group is not None:
        return group.alltoallv(_dense(send), send_rows, out, recv_rows)
    sb = as_buffer(_dense(send), copy_back=False)
    rb = Buffer(out, True, copy_in=False)
    scounts = [r * inner for r in send_rows]
    rcounts = [r * inner for r in recv_rows]
    comm.Alltoallv([sb.mpi, scounts], [rb.mpi, rcounts])
    sb.finish()
    rb.finish()
    return out


def check_same(comm: MPI.Comm, value: object, what: str) -> None:
    """Raise the same error on every rank when ``value`` differs across ranks.

    Collective: turns "mismatched inputs" into an error, not a hang. ``value`` is picklable,
    compared with ``!=`` against rank 0's; the CommError names ``what`` (``"batch size"``) and
    the first rank that differs.
    """
    values = comm.allgather(value)
    if any(v != values[0] for v in values):
        diff = [r for r, v in enumerate(values) if v != values[0]]
        raise CommError(f"{what} differs across ranks: rank 0 has {values[0]!r}, "
                        f"rank {diff[0]} has {values[diff[0]]!r}")
