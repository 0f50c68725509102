"""Resampling a partitioned volume in global coordinates: ``SpatialUpsample``, the module form of
:func:`hpcpar.nn.resample.interpolate` (the geometry, plan and local op live there), and the
pad-or-crop used to line up U-Net skips (``MatchSize`` / ``SpatialMatchSize``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo import halo_exchange
from hpcpar.parallel.halo_plan import HaloPlan, global_spatial_shape
from hpcpar.parallel.partition import axis_halo

from ._base import SpatialModule
from .resample import Interpolation, per_axis, resample_piece

__all__ = ["SpatialUpsample", "MatchSize", "SpatialMatchSize"]

_MODES = ("nearest", "nearest-exact", "trilinear")


class SpatialUpsample(SpatialModule, nn.Upsample):
    """``nn.Upsample`` on a volume partitioned over the grid: nearest, nearest-exact, or trilinear
    with ``align_corners`` True or False, by ``size`` (global) or ``scale_factor`` (non-integer
    too). Exact vs torch on the whole volume; the output is split with the partition rule of its
    global length. The arguments are ``nn.Upsample``'s (another ``mode`` is a LayerError), plus the
    ``grid`` whose x, y, z axes split the volume."""

    def __init__(self, size: int | tuple[int, int, int] | None = None,
                 scale_factor: float | tuple[float, float, float] | None = None,
                 mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None, *, grid: ProcessGrid):
        nn.Upsample.__init__(self, size, scale_factor, mode, align_corners,
                             recompute_scale_factor)
        if mode not in _MODES:
            raise LayerError(f"SpatialUpsample: mode {mode!r} is not supported "
                             f"({', '.join(_MODES)})")
        for what, value in (("size", size), ("scale_factor", scale_factor)):
            if isinstance(value, (tuple, list)) and len(value) != 3:
                raise LayerError(f"SpatialUpsample: {what} {value!r} must have 3 entries")
        self.init_spatial(grid)

    def _geometry(self) -> Interpolation:
        return Interpolation(per_axis(self.size), per_axis(self.scale_factor), self.mode,
                             self.align_corners, self.recompute_scale_factor)

    def axis_halos(self, axis, n):
        return self._geometry().axis_halos(axis, n, self.grid.spatial_shape[axis])

    def make_extra(self, global_shape, halos):
        """Per axis (i0, i1, w1) in the exchanged tensor's local indices."""
        geometry = self._geometry()
        return tuple(geometry.local(a, h) for a, h in enumerate(halos))

    def forward(self, x: torch.Tensor, gshape=None) -> torch.Tensor:
        entry = self.spatial_plan(x, gshape)
        return resample_piece(x, entry.halo, entry.extra)


def _offsets(source, target):
    """Per-axis low-side shift: the extra item of an odd difference goes on the high side."""
    return tuple(int((t - s) / 2) for s, t in zip(source, target))


class MatchSize(nn.Module):
    """Pad with zeros or crop ``x`` so its spatial size equals ``like``'s, centred (an odd
    difference puts the extra item on the high side). Used at U-Net skips. ``spatialize``
    keeps it: on split tensors ``.shape`` is global and ``F.pad`` pads at the global
    boundary, so it is exact as it is, and costs nothing when the sizes match (no message).
    :class:`SpatialMatchSize` is the same rule for hand-written spatial models."""

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        src, dst = x.shape[-3:], like.shape[-3:]
        if tuple(src) == tuple(dst):
            return x
        pads = []
        for s, t, lo in reversed(list(zip(src, dst, _offsets(src, dst)))):
            pads += [lo, t - s - lo]
        return F.pad(x, pads)


class SpatialMatchSize(SpatialModule, nn.Module):
    """:class:`MatchSize` on partitioned tensors: output item t reads global input t - lo;
    the halo exchange moves the items between ranks and pads at the global boundary."""

    def __init__(self, grid: ProcessGrid):
        nn.Module.__init__(self)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        name = self.layer_name
        src = global_spatial_shape(x, self.grid, name)
        dst = global_spatial_shape(like, self.grid, name + " (reference)")
        if src == dst:
            return x
        plan = self._spatial_plans.get((src, dst))
        if plan is None:
            per_axis = []
            for a, (n, t, lo) in enumerate(zip(src, dst, _offsets(src, dst))):
                parts = self.grid.spatial_shape[a]

                def shifted(s: int, e: int, lo: int = lo) -> tuple[int, int]:
                    return s - lo, e - lo

                per_axis.append([axis_halo(n, t, parts, i, shifted) for i in range(parts)])
            plan = self._spatial_plans[(src, dst)] = HaloPlan.from_halos(self.grid, per_axis,
                                                                         name)
        return halo_exchange(x, plan.grid, plan)
