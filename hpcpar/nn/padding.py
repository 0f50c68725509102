"""``F.pad`` on a partitioned volume: constant, replicate, reflect and circular padding (and
cropping, with negative pads) applied at the GLOBAL boundary.

Padding is separable: along each axis, output item o of the padded volume is a copy of one global
input item ``src[o]`` (or the constant). ``src`` is asked from torch itself (``F.pad`` of
``arange(N)``), so every mode's rule, negative pads included (circular wraps around the cropped
volume, as torch does), is torch's own. The output is split with the partition rule of the NEW
length, so data moves between ranks, not only at the boundary: each rank fetches the items its
outputs read from whichever rank of the axis owns them (one ``alltoallv`` on the axis line:
``hpcpar.parallel.primitives.AxisGather``). For small pads only neighbours send anything; circular
padding fetches a slab from the far end; pads and crops wider than a rank's piece reach past the
neighbour. The adjoint sends each output gradient back to the owner of its source item, which ADDS
it in (replicated, reflected and wrapped items collect the gradients of all their copies).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo_plan import AXIS_NAMES
from hpcpar.parallel.partition import xyz
from hpcpar.parallel.primitives import AxisGather, AxisRoute, axis_route

from ._functional import check_piece, same_format, torch_output_shape

__all__ = ["pad"]


@lru_cache(maxsize=512)
def _pad_route(n: int, lo: int, hi: int, mode: str, parts: int, index: int) -> AxisRoute:
    """The route of one axis padded by ``(lo, hi)`` in ``mode``; sources asked from torch."""
    probe = torch.arange(n, dtype=torch.float64).view(1, 1, 1, 1, n)
    fill = {"value": -1.0} if mode == "constant" else {}
    src = F.pad(probe, (lo, hi, 0, 0, 0, 0), mode=mode, **fill).view(-1).long()
    return axis_route(src, n, parts, index)


def pad(x: torch.Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None,
        *, grid: ProcessGrid, gshape: Sequence[int]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``F.pad`` of the whole volume, on this rank's piece ``x`` of the global
    ``(N, C, *gshape)`` tensor.

    ``pad``, ``mode`` and ``value`` are ``F.pad``'s: up to 10 entries, last dim first (entries 7-10
    pad channels and batch, locally; constant mode only, as torch); negative entries crop. Returns
    this rank's piece of the padded volume (split with the partition rule of the new lengths, in
    ``x``'s memory format) and the new global spatial shape. LayerError: a combination torch refuses
    on the whole volume (its message), or ``x`` is not this rank's piece of ``gshape``."""
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
