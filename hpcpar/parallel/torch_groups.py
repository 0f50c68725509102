"""torch.distributed groups standing in for MPI communicators: the messaging functions of
:mod:`.comm` ask :func:`torch_group` whether a group is bound to their communicator for the
tensor at hand, and move it through the group with MPI's conventions (16-bit floats reduced in
float32, booleans as OR/AND, small floating sums in MPI's order). :mod:`.transport` binds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hpcpar.parallel.buffers import wire_dtype

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["TorchGroup", "bind", "unbind", "torch_group"]

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PRODUCT"}


def _op_name(op) -> str:
    """``"sum"``/``"max"``/``"min"``/``"prod"`` for a name or an mpi4py predefined op."""
    if isinstance(op, str):
        return op.lower()
    from mpi4py import MPI

    return {MPI.SUM: "sum", MPI.MAX: "max", MPI.MIN: "min", MPI.PROD: "prod"}[op]


class _Pending:
    """torch.distributed works with the ``wait()``/``test()`` of a :class:`.comm.Handle`
    (for NCCL, ``wait()`` makes the current stream wait; the host does not)."""

    __slots__ = ("works", "result", "after")

    def __init__(self, works: list, result: torch.Tensor | None = None, after=None):
        self.works, self.result, self.after = works, result, after

    def test(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> torch.Tensor | None:
        for w in self.works:
            w.wait()
        self.works = []
        if self.after is not None:
            self.after, after = None, self.after
            after()
        return self.result


#: floating sums and products up to this many gathered bytes reduce in a fixed order
_ORDERED_BYTES = 1 << 20


def _tree(every: torch.Tensor, add) -> torch.Tensor:
    """Combine ``every[r]`` (rank r's tensor) in recursive doubling's order: the ranks past
    the largest power of two first fold into pairs (2i, 2i+1), then a balanced pairwise tree
    over rank order. MPICH reduces in this order at every size, so a small floating sum (the
    spatial collectives': norms, means, pooled features) has the bits of the MPI path on
    every transport and every rank, where a ring allreduce would differ in the last bits."""
    parts = list(every.unbind(0))
    rem = len(parts) - (1 << (len(parts).bit_length() - 1))
    parts = [add(parts[2 * i], parts[2 * i + 1]) for i in range(rem)] + parts[2 * rem:]
    while len(parts) > 1:
        parts = [add(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


#: dtypes Gloo cannot carry: moved as their bytes
_BYTES = (torch.float16, torch.bfloat16, torch.bool)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` (dense), or its bytes where Gloo has no such type (16-bit floats, bool): a view,
    so a receive lands in ``t``."""
    wire_dtype(t.dtype)  # a dtype MPI cannot carry is refused here too, in the same words
    if t.dtype in _BYTES:
        return t.view(-1).view(torch.uint8)
    return t


@dataclass
class TorchGroup:
    """A torch.distributed group (``pg``) over the ranks of an MPI communicator, in its rank
    order, moving tensors of ``device_type``; ``store`` (the rendezvous) lives as long as the
    group; ``release`` shuts it down (collective)."""

    pg: object
    backend: str
    device_type: str
    store: object = None
    release: object = field(default=lambda: None)
    #: an axis line's communicator handle -> its ranks' spatial ranks (or None: out of
    #: order), for :func:`.transport.line_alltoallv`
    lines: dict = field(default_factory=dict)

    def allreduce_(self, t: torch.Tensor, op) -> torch.Tensor:
        """Reduce ``t`` in place, as :func:`.comm.allreduce_` does (16-bit floats in float32,
        booleans as OR/AND)."""
        name = _op_name(op)
        if t.dtype == torch.bool:
            acc = t.to(torch.uint8)
            name = "max" if name in ("sum", "max") else "min"
        elif t.dtype in (torch.float16, torch.bfloat16):
            acc = t.float()
        else:
            acc = t if t.is_contiguous() else t.contiguous()
        size = self.pg.size()  # type: ignore[attr-defined]
        if acc.is_floating_point() and name in ("sum", "prod") and \
                acc.numel() * acc.element_size() * size <= _ORDERED_BYTES:
            every = self.allgather(acc, acc.new_empty((size, *acc.shape)))
            acc = _tree(every, torch.add if name == "sum" else torch.mul)
            t.copy_(acc)
            return t
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, _OPS[name])
        self.pg.allreduce([acc], opts).wait()  # type: ignore[attr-defined]
        if acc is not t:
            t.copy_(acc)
        return t

    def allgather(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (``(size, *t.shape)``, contiguous) with every rank's ``t``."""
        src = _wire(t.contiguous())
        rows = [_wire(row) for row in out.unbind(0)]
        self.pg.allgather([rows], [src]).wait()  # type: ignore[attr-defined]
        return out

    def broadcast_(self, t: torch.Tensor, root: int) -> torch.Tensor:
        """Broadcast the contiguous ``t`` from ``root`` in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([_wire(t)], opts).wait()  # type: ignore[attr-defined]
        return t

    def alltoallv(self, send: torch.Tensor, send_rows: Sequence[int], out: torch.Tensor,
                  recv_rows: Sequence[int]) -> torch.Tensor:
        """Exchange row blocks as :func:`.comm.alltoallv` does, into the contiguous ``out``
        (rows counted along dim 0; 16-bit floats and booleans moved as their bytes)."""
        inner = send[0].numel() if send.shape[0] else out[0].numel() if out.shape[0] else 0
        scale = inner * (send.element_size() if send.dtype in _BYTES else 1)
        src = _wire(send.contiguous().view(-1))
        dst = _wire(out.view(-1))
        self.pg.alltoall_base(dst, src, [r * scale for r in recv_rows],  # type: ignore
                              [r * scale for r in send_rows], dist.AllToAllOptions()).wait()
        return out

    def post(self, recvs: Sequence[tuple], sends: Sequence[tuple]) -> list[_Pending]:
        """Start the receives and sends ``(tensor, peer, tag)`` (dense tensors); a handle per
        message, in that order, whose ``wait()`` returns its tensor. NCCL runs them as one
        group (its sends and receives block until matched, so separate calls posted
        receives-first on both ends would wait for each other): every handle waits for the
        group. Gloo's are independent. A peer of ``MPI.PROC_NULL`` (negative) moves nothing,
        as with MPI."""
        pg = self.pg
        ops = [(pg.recv, m) for m in recvs] + [(pg.send, m) for m in sends]  # type: ignore
        live = [(op, m) for op, m in ops if m[1] >= 0]
        if self.backend == "nccl" and live:
            device = live[0][1][0].device
            pg._start_coalescing(device)  # type: ignore[attr-defined]
            for op, (t, peer, tag) in live:
                op([_wire(t)], peer, tag)
            work = pg._end_coalescing(device)  # type: ignore[attr-defined]
            return [_Pending([work] if m[1] >= 0 else [], m[0]) for _, m in ops]
        return [_Pending([op([_wire(t)], peer, tag)] if peer >= 0 else [], t)
                for op, (t, peer, tag) in ops]


_BOUND: dict[int, TorchGroup] = {}


def _key(comm: MPI.Comm) -> int:
    return int(comm.py2f())


def bind(comm: MPI.Comm, group: TorchGroup) -> None:
    """Move the tensors of ``group``'s device sent over ``comm`` through ``group``."""
    _BOUND[_key(comm)] = group


def unbind(comm: MPI.Comm) -> None:
    """Send ``comm``'s tensors through MPI again."""
    _BOUND.pop(_key(comm), None)


def torch_group(comm: MPI.Comm, t: torch.Tensor) -> TorchGroup | None:
    """The group bound to ``comm`` when it moves ``t``'s device, else None (MPI)."""
    if not _BOUND:
        return None
    group = _BOUND.get(_key(comm))
    return group if group is not None and group.device_type == t.device.type else None
