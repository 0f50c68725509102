"""Resampling a partitioned volume: ``SpatialUpsample`` (nearest, trilinear) and the
pad-or-crop used to line up U-Net skips (``MatchSize`` / ``SpatialMatchSize``).

Both work per axis in global coordinates. The global output length M is split with the
partition rule; the output items a rank owns read a contiguous global input range, which the
halo exchange brings in (negative halo = trim). Which input an output reads is asked from
torch itself (a 1D interpolation of ``arange(N)`` in float64), so index rounding, scale
handling and ``recompute_scale_factor`` are torch's own, exactly.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.partition import axis_halo

from ._base import SpatialModule

__all__ = ["SpatialUpsample", "MatchSize", "SpatialMatchSize"]

_MODES = ("nearest", "trilinear")


def _per_axis(value, what):
    if value is None:
        return (None,) * 3
    if isinstance(value, (tuple, list)):
        if len(value) != 3:
            raise LayerError(f"SpatialUpsample: {what} {value!r} must have 3 entries")
        return tuple(value)
    return (value,) * 3


@lru_cache(maxsize=256)
def _axis_map(n: int, size, scale, mode: str, align_corners, recompute):
    """(M, i0, i1, w1) for one axis of input length n: output o = (1-w1)·x[i0] + w1·x[i1]
    (nearest: w1 = 0, i1 = i0)."""
    probe = torch.arange(n, dtype=torch.float64).view(1, 1, n)
    linear = mode != "nearest"
    src = F.interpolate(probe, size=size, scale_factor=scale,
                        mode="linear" if linear else "nearest",
                        align_corners=align_corners if linear else None,
                        recompute_scale_factor=recompute).view(-1)
    if not linear:
        i0 = src.round().long()
        return src.numel(), i0, i0, None
    i0 = src.floor().long().clamp_(0, n - 1)
    w1 = (src - i0).clamp_(0.0, 1.0)
    i1 = (i0 + 1).clamp_(max=n - 1)
    return src.numel(), i0, i1, w1


def _exchange(x, plan):
    from hpcpar.parallel.halo import halo_exchange

    return halo_exchange(x, plan.grid, plan)


class SpatialUpsample(SpatialModule, nn.Upsample):
    """``nn.Upsample`` on a volume partitioned over the grid: nearest, or trilinear with
    ``align_corners`` True or False, by ``size`` (global) or ``scale_factor``. Exact vs torch
    on the whole volume; the output is split with the partition rule of its global length.

    Args:
        size: Global output size (int or 3 ints), as ``nn.Upsample``.
        scale_factor: As ``nn.Upsample``.
        mode: ``"nearest"`` or ``"trilinear"``.
        align_corners: As ``nn.Upsample`` (trilinear only).
        recompute_scale_factor: As ``nn.Upsample``.
        grid: The process grid whose x, y, z axes split the volume.

    Raises:
        LayerError: Another ``mode``.
    """

    def __init__(self, size: int | tuple[int, int, int] | None = None,
                 scale_factor: float | tuple[float, float, float] | None = None,
                 mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None, *, grid: ProcessGrid):
        nn.Upsample.__init__(self, size, scale_factor, mode, align_corners,
                             recompute_scale_factor)
        if mode not in _MODES:
            raise LayerError(f"SpatialUpsample: mode {mode!r} is not supported "
                             "(nearest or trilinear)")
        self.init_spatial(grid)

    def _map(self, axis, n):
        size = _per_axis(self.size, "size")[axis]
        scale = _per_axis(self.scale_factor, "scale_factor")[axis]
        return _axis_map(n, size, scale, self.mode, self.align_corners,
                         self.recompute_scale_factor)

    def axis_halos(self, axis, n):
        m, i0, i1, _ = self._map(axis, n)

        def needed(s, e):
            return (s, s) if e <= s else (int(i0[s:e].min()), int(i1[s:e].max()) + 1)

        parts = self.grid.spatial_shape[axis]
        return [axis_halo(n, m, parts, i, needed) for i in range(parts)]

    def make_extra(self, global_shape, halos):
        """Per axis (i0, i1, w1) in the exchanged tensor's local indices."""
        local = []
        for a, h in enumerate(halos):
            _, i0, i1, w1 = self._map(a, global_shape[a])
            (s, e), lo = h.out, h.needed[0]
            local.append((i0[s:e] - lo, i1[s:e] - lo, None if w1 is None else w1[s:e]))
        return local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Upsample this rank's piece; returns its piece of the global output."""
        entry = self.spatial_plan(x)
        dtype = x.dtype
        x = _exchange(x, entry.halo)
        if entry.extra[0][2] is not None and dtype in (torch.float16, torch.bfloat16):
            x = x.float()  # blend 16-bit inputs in float32, as torch does
        for dim, (i0, i1, w1) in zip((2, 3, 4), entry.extra):
            i0 = i0.to(x.device)
            if w1 is None:
                x = x.index_select(dim, i0)
                continue
            shape = [1] * 5
            shape[dim] = -1
            w = w1.to(device=x.device, dtype=x.dtype).view(shape)
            a, b = x.index_select(dim, i0), x.index_select(dim, i1.to(x.device))
            x = a + (b - a) * w
        return x.to(dtype)


def _offsets(source, target):
    """Per-axis low-side shift: the extra item of an odd difference goes on the high side."""
    return tuple(int((t - s) / 2) for s, t in zip(source, target))


class MatchSize(nn.Module):
    """Pad with zeros or crop ``x`` so its spatial size equals ``like``'s, centred (an odd
    difference puts the extra item on the high side). Used at U-Net skips; ``spatialize``
    turns it into :class:`SpatialMatchSize`, which does the same in global coordinates."""

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Zero-pad or crop ``x`` (centred) to the spatial size of ``like``."""
        src, dst = x.shape[-3:], like.shape[-3:]
        if tuple(src) == tuple(dst):
            return x
        pads = []
        for s, t, lo in reversed(list(zip(src, dst, _offsets(src, dst)))):
            pads += [lo, t - s - lo]
        return F.pad(x, pads)

    def spatial_twin(self, grid: ProcessGrid) -> nn.Module:
        """The ``SpatialMatchSize`` that ``spatialize`` puts in its place."""
        return SpatialMatchSize(grid)


class SpatialMatchSize(SpatialModule, nn.Module):
    """:class:`MatchSize` on partitioned tensors: output item t reads global input t - lo;
    the halo exchange moves the items between ranks and pads at the global boundary."""

    def __init__(self, grid: ProcessGrid):
        nn.Module.__init__(self)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Pad or crop this rank's piece of ``x`` to its piece of ``like``'s global size."""
        from hpcpar.parallel.halo import HaloPlan, global_spatial_shape

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
                per_axis.append([axis_halo(n, t, parts, i, lambda s, e, lo=lo: (s - lo, e - lo))
                                 for i in range(parts)])
            plan = self._spatial_plans[(src, dst)] = HaloPlan.from_halos(self.grid, per_axis,
                                                                         name)
        return _exchange(x, plan)
