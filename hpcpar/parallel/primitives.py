"""The collective autograd Functions that no one layer's geometry owns, in one place, each
with its adjoint pair and a test of it (``tests/parallel/test_adjoints.py``).

Inner products count a split tensor on every rank (summed) and a replicated one once (DESIGN
section 2). Under that convention "allreduce forward, identity backward"
(:class:`ReplicatedSum`) and "identity forward, allreduce backward" (:class:`SumGrad`) are each
other's adjoint, and the adjoint of gathering a replicated result is taking a slice.

Functions bound to a layer stay beside it: the halo exchange and stencils (:mod:`.halo`), the
convolution routes, the norms' fused statistics, the tensor-parallel linear, the graph halo.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpcpar.parallel.comm import allreduce_
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.partition import box, part_range, part_ranges
from hpcpar.parallel.spatial import allgather_volume
from hpcpar.parallel.transport import line_alltoallv

__all__ = ["ReplicatedSum", "SumGrad", "GatherVolume", "SquaredDeviation", "GlobalExtreme",
           "AxisRoute", "axis_route", "AxisGather"]


class ReplicatedSum(torch.autograd.Function):
    """Sum of every rank's partial ``t`` over ``comm``: allreduce in forward; identity in
    backward (the replicated result's upstream gradient is the same on every rank, so each
    rank's gradient is its own part's). Adjoint of :class:`SumGrad`."""

    @staticmethod
    def forward(ctx, t, comm):
        return allreduce_(t.detach().clone(), comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SumGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over ``comm`` backward: a replicated tensor used
    on every rank's piece gets the partial gradients of all pieces. Adjoint of
    :class:`ReplicatedSum`."""

    @staticmethod
    def forward(ctx, t, comm):
        ctx.comm = comm
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return allreduce_(grad.contiguous().clone(), ctx.comm), None


class GatherVolume(torch.autograd.Function):
    """This rank's ``(N, C, d, h, w)`` piece -> the whole volume on every rank of the spatial
    group (allgather); backward: this rank's slice of the replicated gradient."""

    @staticmethod
    def forward(ctx, x, grid: ProcessGrid):
        full, own = allgather_volume(x.detach(), grid)
        ctx.own = own
        return full

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.own].contiguous(), None


class SquaredDeviation(torch.autograd.Function):
    """Σ(x - mean)² over ``dims`` (keepdim, float64), replicated, with the GLOBAL mean of
    ``count`` items: two allreduces, so the deviations are taken from the exact mean
    (two-pass). Backward is 2(x - mean)·g with no message: the mean's own gradient is
    2·Σ(x - mean)·g = 0 over the whole tensor (torch's var_backward). Saves x and the small
    mean, not the full-size deviations."""

    @staticmethod
    def forward(ctx, x, dims, count, comm):
        mean = allreduce_(x.sum(dims, keepdim=True, dtype=torch.float64), comm).div_(count)
        dev = x - mean.to(x.dtype)
        m2 = allreduce_(dev.square_().sum(dims, keepdim=True, dtype=torch.float64), comm)
        ctx.save_for_backward(x, mean)
        return m2

    @staticmethod
    def backward(ctx, grad):
        x, mean = ctx.saved_tensors
        dx = (x - mean.to(x.dtype)).mul_((2 * grad).to(x.dtype))
        return dx, None, None, None


class GlobalExtreme(torch.autograd.Function):
    """``amax``/``amin`` over ``dims`` (keepdim), replicated: a max/min allreduce of the local
    extremes. Backward gives g to the extremes torch's op picks: split evenly over every
    element equal to the extreme on ANY rank (torch's amax; one allreduce of the tie counts),
    or, given ``first=(grid, gshape)`` for a reduction over the three spatial dims, all of it
    to the first in global (d, h, w) order (torch's ``adaptive_max_pool3d(x, 1)``; one more
    allreduce in forward, the min of global indices)."""

    @staticmethod
    def forward(ctx, x, dims, op, comm, first=None):
        local = x.amax(dims, keepdim=True) if op == "amax" else x.amin(dims, keepdim=True)
        ext = allreduce_(local, comm, "max" if op == "amax" else "min")
        ctx.dims, ctx.comm, ctx.first, ctx.shape = dims, comm, first is not None, x.shape
        # the first-extreme route keeps one index per (n, c), not a mask the size of x
        ctx.save_for_backward(*((x, ext) if first is None else _first_hit(x == ext, *first)))
        return ext

    @staticmethod
    def backward(ctx, grad):
        if ctx.first:
            index, mine = ctx.saved_tensors
            out = grad.new_zeros((*index.shape, math.prod(ctx.shape[-3:])))
            out.scatter_(-1, index.unsqueeze(-1), (grad.reshape(index.shape) * mine)[..., None])
            return out.view(ctx.shape), None, None, None, None
        x, ext = ctx.saved_tensors
        hit = x == ext
        ties = allreduce_(hit.sum(ctx.dims, keepdim=True, dtype=torch.float64), ctx.comm)
        return hit.to(x.dtype).mul_(grad / ties.to(grad.dtype)), None, None, None, None


def _first_hit(hit: torch.Tensor, grid: ProcessGrid,
               gshape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Of ``hit`` (the extremes over the last three dims), the first in global (d, h, w)
    order over the spatial group (one allreduce: the min of global indices): this piece's
    flat index of its first hit and whether that one is the global first, per (n, c)."""
    lead, local = hit.shape[:-3], hit.shape[-3:]
    flat = hit.reshape(*lead, -1)
    index = flat.byte().argmax(-1)                     # this piece's first extreme
    origin = box(gshape, grid.spatial_shape, grid.spatial_coords)
    at = torch.zeros_like(index)
    for a in range(3):  # this piece's flat index -> global (d, h, w) -> global flat index
        step = math.prod(local[a + 1:])
        at = at * gshape[a] + (index // step) % local[a] + origin[a][0]
    first = torch.where(flat.any(-1), at, torch.full_like(at, math.prod(gshape)))
    winner = allreduce_(first.clone(), grid.spatial_comm, "min")
    return index, winner == first


@dataclass(frozen=True)
class AxisRoute:
    """One rank's part of ``out[o] = x[src[o]]`` (``src[o] < 0``: a fill value) along one axis.

    ``send_index``: local items sent, grouped by destination coordinate, ``send_rows`` of them
    to each (this rank's own share included); ``recv_rows`` from each: together, in coordinate
    order, the sorted distinct global items this rank's outputs read. ``position``: each
    owned output's row in ``cat(received, fill)``; ``length``: items owned on the axis.
    """

    send_index: torch.Tensor
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    position: torch.Tensor
    length: int


def axis_route(src: torch.Tensor, n: int, parts: int, index: int) -> AxisRoute:
    """The route of part ``index`` of ``parts`` (ranks on the axis) for the gather
    ``out[o] = x[src[o]]`` along one axis of global input length ``n`` (``src[o] < 0``: the
    fill value). Input and output (length ``len(src)``) are split with the partition rule;
    every part derives every other part's needs, so sends and receives match unnegotiated."""
    m = src.numel()

    def reads(part):  # sorted distinct input items the part's outputs read
        u = torch.unique(src[slice(*part_range(m, parts, part))])
        return u[u >= 0]

    own0, own1 = part_range(n, parts, index)
    sends = []
    for part in range(parts):
        u = reads(part)
        sends.append(u[(u >= own0) & (u < own1)] - own0)
    mine = reads(index)
    recv_rows = tuple(int(((mine >= a) & (mine < b)).sum()) for a, b in part_ranges(n, parts))
    out = src[slice(*part_range(m, parts, index))]
    position = torch.searchsorted(mine, out.clamp(min=0))
    position[out < 0] = mine.numel()
    return AxisRoute(torch.cat(sends), tuple(s.numel() for s in sends), recv_rows, position,
                     own1 - own0)


class AxisGather(torch.autograd.Function):
    """``out = cat(fetched, fill).index_select(dim, position)``: each rank fetches the items
    its outputs read from their owners (``alltoallv`` over the axis line ``comms``; local
    when None). Backward is the adjoint: gradients of all copies of an item are summed, sent
    back to its owner and ADDED into it."""

    @staticmethod
    def forward(ctx, x, route: AxisRoute, dim: int, comms, fill):
        rows = x.detach().movedim(dim, 0).index_select(0, route.send_index.to(x.device))
        got = rows if comms is None else line_alltoallv(rows, route.send_rows, comms[0],
                                                         comms[1], route.recv_rows)
        ext = torch.cat([got, got.new_full((1, *got.shape[1:]), fill)])
        ctx.route, ctx.dim, ctx.comms = route, dim, comms
        return ext.index_select(0, route.position.to(x.device)).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route
        g = grad.movedim(ctx.dim, 0)
        slots = g.new_zeros((sum(route.recv_rows) + 1, *g.shape[1:]))
        slots.index_add_(0, route.position.to(g.device), g)
        back = slots[:-1]
        if ctx.comms is not None:
            back = line_alltoallv(back, route.recv_rows, ctx.comms[0], ctx.comms[1],
                                  route.send_rows)
        gx = g.new_zeros((route.length, *g.shape[1:]))
        gx.index_add_(0, route.send_index.to(g.device), back)
        return gx.movedim(0, ctx.dim), None, None, None, None
