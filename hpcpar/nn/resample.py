"""Resampling a partitioned volume: ``F.interpolate`` (nearest, nearest-exact, trilinear, area)
and adaptive average / max pooling, for any output size.

Both work per axis in global coordinates. The global output length M is split with the
partition rule; the outputs a rank owns read a contiguous global input range, which the halo
exchange brings in (negative halo = trim), then a local op computes the owned outputs:

* interpolation: which inputs an output reads, and their weights, are asked from torch itself
  (a 1D interpolation of ``arange(N)`` in float64), so index rounding, scales,
  ``align_corners`` and ``recompute_scale_factor`` are torch's own, exactly.
* adaptive pooling: output cell o of an axis of length N covers inputs
  ``[floor(o·N/M), ceil((o+1)·N/M))``. torch's adaptive pool on the fetched range would use
  windows of the LOCAL lengths (different cells), so each axis reduces its owned cells' windows
  explicitly (a gather of every window, padded to the longest by repeating its last item). Max
  reduces the last axis first, each keeping the first maximum: torch's pick. An output of 1 on
  every axis is a global pool: one allreduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo import StencilOp, halo_exchange, halo_stencil
from hpcpar.parallel.halo_plan import HaloPlan
from hpcpar.parallel.partition import AxisHalo, axis_halo, ceil_div, xyz
from hpcpar.parallel.primitives import GlobalExtreme

from ._functional import check_piece, same_format, torch_output_shape
from .gather import global_mean

__all__ = ["interpolate", "adaptive_avg_pool3d", "adaptive_max_pool3d", "INTERPOLATE_MODES",
           "Interpolation", "resample_piece", "per_axis", "AdaptivePoolOp"]

#: The modes of :func:`interpolate` (every mode torch accepts on a 5D input).
INTERPOLATE_MODES = ("nearest", "nearest-exact", "trilinear", "area")


def per_axis(value) -> tuple:
    """torch's one-or-three convention as a hashable triple (``None``: three ``None``)."""
    if isinstance(value, (tuple, list)):
        return tuple(value)
    return (value,) * 3


# --- interpolation ----------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _axis_map(n: int, size, scale, mode: str, align_corners, recompute):
    """(M, i0, i1, w1) for one axis of input length n: output o = (1-w1)·x[i0] + w1·x[i1]
    (nearest modes: w1 None, i1 = i0)."""
    probe = torch.arange(n, dtype=torch.float64).view(1, 1, n)
    linear = mode == "trilinear"
    src = F.interpolate(probe, size=size, scale_factor=scale,
                        mode="linear" if linear else mode,
                        align_corners=align_corners if linear else None,
                        recompute_scale_factor=recompute).view(-1)
    if not linear:
        i0 = src.round().long()
        return src.numel(), i0, i0, None
    i0 = src.floor().long().clamp_(0, n - 1)
    w1 = (src - i0).clamp_(0.0, 1.0)
    i1 = (i0 + 1).clamp_(max=n - 1)
    return src.numel(), i0, i1, w1


@dataclass(frozen=True)
class Interpolation:
    """The per-axis geometry of one ``F.interpolate`` call (hashable: plans are cached by it).
    :class:`hpcpar.nn.upsample.SpatialUpsample` and :func:`interpolate` both plan with it. ``sizes``
    are global output lengths (``None``: from ``scales``, and the reverse); ``mode`` is
    ``"nearest"``, ``"nearest-exact"`` or ``"trilinear"``; the rest as ``F.interpolate``."""

    sizes: tuple
    scales: tuple
    mode: str
    align_corners: bool | None = None
    recompute_scale_factor: bool | None = None

    def _map(self, axis: int, n: int):
        return _axis_map(n, self.sizes[axis], self.scales[axis], self.mode,
                         self.align_corners, self.recompute_scale_factor)

    def axis_halos(self, axis: int, n: int, parts: int) -> list[AxisHalo]:
        """Every rank's halo on ``axis`` (input length ``n`` over ``parts`` ranks)."""
        _, i0, i1, _ = self._map(axis, n)

        def needed(s, e):
            return (s, s) if e <= s else (int(i0[s:e].min()), int(i1[s:e].max()) + 1)

        return [axis_halo(n, len(i0), parts, i, needed) for i in range(parts)]

    def local(self, axis: int, halo: AxisHalo):
        """(i0, i1, w1) of this rank's outputs on ``axis``, indexing the exchanged tensor."""
        _, i0, i1, w1 = self._map(axis, halo.n_in)
        (s, e), lo = halo.out, halo.needed[0]
        return i0[s:e] - lo, i1[s:e] - lo, None if w1 is None else w1[s:e]


@lru_cache(maxsize=64)
def _interpolation_plan(grid: ProcessGrid, gshape, geometry: Interpolation, layer: str):
    """(halo plan, per axis (i0, i1, w1)) of this rank, for :func:`resample_piece`."""
    per_axis = [geometry.axis_halos(a, n, p) for a, (n, p) in
                enumerate(zip(gshape, grid.spatial_shape))]
    local = tuple(geometry.local(a, per_axis[a][c]) for a, c in enumerate(grid.spatial_coords))
    return HaloPlan.from_halos(grid, per_axis, layer), local


def resample_piece(x: torch.Tensor, plan: HaloPlan, local: Sequence[tuple]) -> torch.Tensor:
    """Exchange the halo, then pick (nearest) or blend (trilinear) along each axis by ``local``
    (per axis :meth:`Interpolation.local`); the output piece is in ``x``'s memory format."""
    dtype = x.dtype
    y = halo_exchange(x, plan.grid, plan)
    if local[0][2] is not None and dtype in (torch.float16, torch.bfloat16):
        y = y.float()  # blend 16-bit inputs in float32, as torch does
    for dim, (i0, i1, w1) in zip((2, 3, 4), local):
        i0 = i0.to(y.device)
        if w1 is None:
            y = y.index_select(dim, i0)
            continue
        shape = [1] * 5
        shape[dim] = -1
        w = w1.to(device=y.device, dtype=y.dtype).view(shape)
        a, b = y.index_select(dim, i0), y.index_select(dim, i1.to(y.device))
        y = a + (b - a) * w
    return same_format(y.to(dtype), x)


def interpolate(x: torch.Tensor, size: int | Sequence[int] | None = None,
                scale_factor: float | Sequence[float] | None = None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                *, grid: ProcessGrid, gshape: Sequence[int],
                layer: str = "interpolate") -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``F.interpolate`` of the whole volume, on this rank's piece ``x`` (``(N, C, d, h, w)``)
    of the global ``(N, C, *gshape)`` tensor.

    ``size`` is the global output size; the arguments are ``F.interpolate``'s (non-integer scales
    included; ``"area"`` is :func:`adaptive_avg_pool3d`, as torch); ``layer`` is the name errors
    give. Returns this rank's piece of the output (split with the partition rule of the output's
    lengths, in ``x``'s memory format) and the output's global spatial shape. Raises LayerError for
    arguments torch refuses on the whole volume, and for an output range that reaches past a
    neighbour's piece (downsampling over too many ranks: the message gives the smallest piece that
    works)."""
    check_piece(layer, x, grid, gshape)
    out = torch_output_shape(layer, lambda t: F.interpolate(
        t, size, scale_factor, mode, align_corners, recompute_scale_factor), x, gshape,
        repr((size, scale_factor, mode, align_corners, recompute_scale_factor)))[2:]
    if mode == "area":
        return adaptive_avg_pool3d(x, out, grid=grid, gshape=gshape)
    if mode not in INTERPOLATE_MODES:
        raise LayerError(f"{layer}: mode {mode!r} is not supported on a split volume (one of "
                         f"{', '.join(INTERPOLATE_MODES)})")
    geometry = Interpolation(per_axis(size), per_axis(scale_factor), mode, align_corners,
                             recompute_scale_factor)
    return resample_piece(x, *_interpolation_plan(grid, tuple(gshape), geometry, layer)), \
        xyz(out)


# --- adaptive pooling -------------------------------------------------------------------------
def _window_table(start: int, n: int, m: int, cells: range):
    """(index, weight) of ``cells`` on an axis of length n pooled to m, ``index`` relative to
    global item ``start``: shape (cells, longest window); a short window repeats its last
    item (never a new maximum) with weight 0."""
    first = [o * n // m for o in cells]
    length = [ceil_div((o + 1) * n, m) - f for o, f in zip(cells, first)]
    k = max(length, default=0)
    t = torch.arange(k)
    ln = torch.tensor(length, dtype=torch.long).view(-1, 1)
    index = torch.tensor(first, dtype=torch.long).view(-1, 1) - start + torch.minimum(t, ln - 1)
    weight = (t < ln).double() / ln
    return index, weight


class AdaptivePoolOp(StencilOp):
    """Reduce (``"max"`` or ``"avg"``) each owned cell's window, axis by axis (last axis
    first), on the fetched range; ``tables`` holds per axis :func:`_window_table`'s pair."""

    def __init__(self, tables: tuple[tuple[torch.Tensor, torch.Tensor], ...], reduce: str):
        self.tables, self.reduce = tables, reduce

    def forward(self, ext):
        out = tuple(index.shape[0] for index, _ in self.tables)
        if 0 in out:
            return ext.new_zeros((*ext.shape[:2], *out))
        for dim in (4, 3, 2):
            index, weight = self.tables[dim - 2]
            g = ext.index_select(dim, index.view(-1).to(ext.device)).unflatten(dim, index.shape)
            if self.reduce == "max":
                ext = g.max(dim + 1).values   # the first maximum: torch's pick
            else:
                shape = [1] * 6
                shape[dim:dim + 2] = index.shape
                ext = (g * weight.to(ext.device, ext.dtype).view(shape)).sum(dim + 1)
        return ext

    def backward(self, holder, grad_out, params, needs):
        if grad_out.numel() == 0:  # this rank owns no cell (an output shorter than the grid)
            return (torch.zeros_like(holder.pop()),)
        return super().backward(holder, grad_out, params, needs)


@lru_cache(maxsize=64)
def _adaptive_plan(grid: ProcessGrid, gshape, sizes, reduce, layer):
    per_axis, tables = [], []
    for a, (n, m) in enumerate(zip(gshape, sizes)):
        def needed(s, e, n=n, m=m):
            return (s * n // m, ceil_div(e * n, m)) if e > s else (0, 0)

        parts = grid.spatial_shape[a]
        halos = [axis_halo(n, m, parts, i, needed) for i in range(parts)]
        per_axis.append(halos)
        h = halos[grid.spatial_coords[a]]
        tables.append(_window_table(h.needed[0], n, m, range(*h.out)))
    return HaloPlan.from_halos(grid, per_axis, layer), AdaptivePoolOp(tuple(tables), reduce)


def _adaptive(x, output_size, grid, gshape, reduce, torch_fn, layer):
    check_piece(layer, x, grid, gshape)
    out = torch_output_shape(layer, lambda t: torch_fn(t, output_size), x, gshape,
                             repr(output_size))[2:]
    if out == (1, 1, 1):
        if reduce == "max":
            return GlobalExtreme.apply(x, (-3, -2, -1), "amax", grid.spatial_comm,
                                       (grid, tuple(gshape))), out
        return global_mean(x, grid), out
    plan, op = _adaptive_plan(grid, tuple(gshape), out, reduce, layer)
    return same_format(halo_stencil(x, plan, op), x), out


def adaptive_avg_pool3d(x: torch.Tensor, output_size: int | Sequence[int | None], *,
                        grid: ProcessGrid,
                        gshape: Sequence[int]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``F.adaptive_avg_pool3d`` of the whole volume, on this rank's piece ``x`` of the global
    ``(N, C, *gshape)`` tensor (``output_size`` as torch: ``None`` keeps that axis's length).

    Returns this rank's piece of the output (split with the partition rule of the output's lengths,
    in ``x``'s memory format) and its global spatial shape. An output of 1 on every axis (a global
    mean) is REPLICATED: the whole ``(N, C, 1, 1, 1)`` on every rank. Raises LayerError for an
    ``output_size`` torch refuses, and for cells wider than a neighbour's piece (an output much
    shorter than the ranks on an axis: the message gives the smallest piece that works)."""
    return _adaptive(x, output_size, grid, gshape, "avg", F.adaptive_avg_pool3d,
                     "adaptive_avg_pool3d")


def adaptive_max_pool3d(x: torch.Tensor, output_size: int | Sequence[int | None],
                        return_indices: bool = False, *, grid: ProcessGrid,
                        gshape: Sequence[int]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``F.adaptive_max_pool3d`` of the whole volume, on this rank's piece: as
    :func:`adaptive_avg_pool3d`, with maxima (a global max is replicated). Ties pick torch's voxel
    (the first in (d, h, w) order), which alone gets the gradient. ``return_indices`` must be False
    (LayerError otherwise)."""
    if return_indices:
        raise LayerError("adaptive_max_pool3d: return_indices=True is not supported on a split "
                         "volume (indices of a piece do not address the global volume)")
    return _adaptive(x, output_size, grid, gshape, "max", F.adaptive_max_pool3d,
                     "adaptive_max_pool3d")
