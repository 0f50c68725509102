"""``F.pad`` on a partitioned volume: constant, replicate, reflect and circular padding (and
cropping, with negative pads) applied at the GLOBAL boundary.

Padding is separable: along each axis, output item o of the padded volume is a copy of one
global input item ``src[o]`` (or the constant). ``src`` is asked from torch itself (``F.pad`` of
``arange(N)``), so every mode's rule, negative pads included (circular wraps around the cropped
volume, as torch does), is torch's own. The output is split with the partition rule of the NEW
length, so data moves between ranks, not only at the boundary: each rank fetches the items its
outputs read from whichever rank of the axis owns them (:class:`AxisGather`, one ``alltoallv``
on the axis line). For small pads only neighbours send anything; circular padding fetches a
slab from the far end; pads and crops wider than a rank's piece reach past the neighbour.
The adjoint sends each output gradient back to the owner of its source item, which ADDS it in
(replicated, reflected and wrapped items collect the gradients of all their copies).

Entries 7-10 of ``pad`` (channels, batch) are local; torch allows them in constant mode only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo_plan import AXIS_NAMES
from hpcpar.parallel.partition import part_range, part_ranges, xyz
from hpcpar.parallel.transport import line_alltoallv

from ._functional import check_piece, same_format, torch_output_shape

__all__ = ["pad", "AxisRoute", "axis_route", "AxisGather"]


@dataclass(frozen=True)
class AxisRoute:
    """One rank's part of ``out[o] = x[src[o]]`` (``src[o] < 0``: a fill value) along one axis.

    Attributes:
        send_index: Local items sent, grouped by destination coordinate on the axis.
        send_rows: How many go to each coordinate (this rank's own share included).
        recv_rows: How many come from each coordinate: together, in coordinate order, the
            sorted distinct global items this rank's outputs read.
        position: For each owned output, its row in ``cat(received, fill)``.
        length: Items this rank owns on the axis.
    """

    send_index: torch.Tensor
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    position: torch.Tensor
    length: int


def axis_route(src: torch.Tensor, n: int, parts: int, index: int) -> AxisRoute:
    """The route of part ``index`` for the gather ``out[o] = x[src[o]]`` along one axis.

    Both the input (length ``n``) and the output (length ``len(src)``) are split with the
    partition rule over ``parts``; every part derives every other part's needs, so sends and
    receives match with no negotiation.

    Args:
        src: Global source item of every output item (negative: the fill value).
        n: Global input length.
        parts: Ranks on the axis.
        index: This rank's coordinate on the axis.

    Returns:
        The route.
    """
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
    its outputs read from their owners (``alltoallv`` over the axis line; local with one rank).
    Backward is the adjoint: gradients of all copies of an item are summed, sent back to its
    owner and ADDED into it."""

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


@lru_cache(maxsize=512)
def _pad_route(n: int, lo: int, hi: int, mode: str, parts: int, index: int) -> AxisRoute:
    """The route of one axis padded by ``(lo, hi)`` in ``mode``; sources asked from torch."""
    probe = torch.arange(n, dtype=torch.float64).view(1, 1, 1, 1, n)
    fill = {"value": -1.0} if mode == "constant" else {}
    src = F.pad(probe, (lo, hi, 0, 0, 0, 0), mode=mode, **fill).view(-1).long()
    return axis_route(src, n, parts, index)


def pad(x: torch.Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None,
        *, grid: ProcessGrid, gshape: Sequence[int]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``F.pad`` of the whole volume, on this rank's piece.

    Args:
        x: This rank's piece ``(N, C, d, h, w)`` of the global ``(N, C, *gshape)`` tensor.
        pad: As ``F.pad``: up to 10 entries, last dim first (entries 7-10 pad channels and
            batch, locally; constant mode only, as torch). Negative entries crop.
        mode: ``"constant"``, ``"replicate"``, ``"reflect"`` or ``"circular"``.
        value: The constant (constant mode; torch's default 0).
        grid: The process grid.
        gshape: The global spatial shape ``(D, H, W)`` (the same on every rank).

    Returns:
        This rank's piece of the padded volume (split with the partition rule of the new
        lengths, in ``x``'s memory format), and the new global spatial shape.

    Raises:
        LayerError: A combination torch refuses on the whole volume (its message), or ``x``
            is not this rank's piece of ``gshape``.
    """
    pad = tuple(int(p) for p in pad)
    check_piece("pad", x, grid, gshape)
    out = torch_output_shape("pad", lambda t: F.pad(t, pad, mode, value), x, gshape,
                             repr((pad, mode, value)))
    spatial = pad[:6] + (0,) * (6 - len(pad[:6]))
    y = x
    for a, name in enumerate(AXIS_NAMES):
        lo, hi = spatial[4 - 2 * a], spatial[5 - 2 * a]   # F.pad's pairs go last dim first
        if lo == 0 and hi == 0:
            continue
        parts = grid.spatial_shape[a]
        route = _pad_route(gshape[a], lo, hi, mode, parts, grid.spatial_coords[a])
        comms = (grid.axis_comm(name), grid.spatial_comm) if parts > 1 else None
        y = AxisGather.apply(y, route, 2 + a, comms, 0.0 if value is None else value)
    if len(pad) > 6:
        y = F.pad(y, (0,) * 6 + pad[6:], value=0.0 if value is None else value)
    return same_format(y, x), xyz(out[2:])
