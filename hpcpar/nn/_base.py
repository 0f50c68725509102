"""Base of spatial (halo-exchanging) layers: grid, per-shape plan cache, size checks.

How to write a spatial layer (conv, pool, upsample, ...)::

    class SpatialFoo(SpatialModule, nn.Foo):          # mixin first, torch twin second
        def __init__(self, *torch_args, grid, **torch_kwargs):
            nn.Foo.__init__(self, *torch_args, **torch_kwargs)
            self.init_spatial(grid)

        def axis_halos(self, axis, n):                 # axis 0/1/2 = x/y/z, n = global length
            return [conv_axis_halo(n, P, i, k, s, p) for i in range(P)]   # every rank's halo

        def forward(self, x):
            entry = self.spatial_plan(x)               # collective: one small allgather
            return halo_stencil(x, entry.halo, MyOp(...), *params, pad_value=0.0)

:meth:`SpatialModule.spatial_plan` returns a :class:`SpatialPlan` (global shape, this rank's
three AxisHalo, the :class:`~hpcpar.parallel.halo_plan.HaloPlan`, plus whatever :meth:`make_extra`
returns). Plans are cached by GLOBAL shape, which every rank learns from the same collective
(:func:`hpcpar.parallel.halo_plan.global_spatial_shape`), so all ranks hit or miss together (a
cache keyed by local shape could go stale on one rank only: N=9 and N=10 over 2 ranks both give
rank 0 an extent of 5). Errors raised while planning (too many ranks for the volume: "local extent
smaller than the halo", naming the layer, the axis and the minimum size; a grid axis longer
than the dimension) are derived from every rank's data, so they are raised on all ranks alike.

Torch twins: the mixin adds only plain attributes (``grid``, the cache), so ``state_dict``
keys and shapes are the twin's and each loads the other's. ``copy.deepcopy`` shares the grid.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpcpar.errors import LayerError
from hpcpar.parallel.halo_plan import AXIS_NAMES, HaloPlan, global_spatial_shape
from hpcpar.parallel.partition import AxisHalo, xyz

if TYPE_CHECKING:
    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["SpatialModule", "SpatialPlan", "check_axis_length", "triple"]


@dataclass(frozen=True)
class SpatialPlan:
    global_shape: tuple[int, int, int]
    halos: tuple[AxisHalo, AxisHalo, AxisHalo]  # this rank's, x/y/z
    halo: HaloPlan
    extra: Any = None
    out_shape: tuple[int, ...] = ()  # the output's global spatial shape


class SpatialModule:
    """Mixin for spatial layers; see the module docstring for the recipe."""

    if TYPE_CHECKING:
        grid: ProcessGrid  # set by init_spatial
    else:
        grid = None

    def init_spatial(self, grid) -> None:
        if grid is None or not hasattr(grid, "spatial_comm"):
            raise LayerError(f"{type(self).__name__}: pass grid=hpcpar.ProcessGrid(...)")
        self.grid = grid
        self._spatial_plans: dict = {}

    @property
    def layer_name(self) -> str:
        return type(self).__name__

    def axis_halos(self, axis: int, n: int) -> list[AxisHalo]:
        """Every rank's AxisHalo on ``axis`` (index = coordinate) for global length ``n``."""
        raise NotImplementedError

    def make_extra(self, global_shape, halos) -> Any:
        """Per-plan data the layer wants cached next to the halo plan (default none)."""
        return None

    def spatial_plan(self, x, gshape: tuple[int, int, int] | None = None) -> SpatialPlan:
        """Plan for input ``x`` (cached by global shape). Collective over the spatial group
        unless the caller knows the global shape (``gshape``: a split tensor carries it)."""
        shape = global_spatial_shape(x, self.grid, what=self.layer_name) if gshape is None \
            else tuple(gshape)
        entry = self._spatial_plans.get(shape)
        if entry is None:
            entry = self._spatial_plans[shape] = self._build_plan(shape)
        return entry

    def out_gshape(self, gshape) -> tuple[int, int, int]:
        """The output's global spatial shape for input ``gshape`` (no halo plan, no
        message: a layer that takes another route than the halo exchange has one too)."""
        cache = self.__dict__.setdefault("_out_gshapes", {})
        key = tuple(gshape)
        if key not in cache:
            cache[key] = xyz(self.axis_halos(a, key[a])[0].n_out for a in range(3))
        return cache[key]

    def _build_plan(self, shape) -> SpatialPlan:
        dims = self.grid.spatial_shape
        per_axis = []
        for a in range(3):
            check_axis_length(self.layer_name, a, shape[a], dims[a])
            per_axis.append(list(self.axis_halos(a, shape[a])))
        halo = HaloPlan.from_halos(self.grid, per_axis, self.layer_name)
        mine = xyz(per_axis[a][self.grid.spatial_coords[a]] for a in range(3))
        return SpatialPlan(shape, mine, halo, self.make_extra(shape, mine),
                           self.out_gshape(shape))

    def __deepcopy__(self, memo):
        memo[id(self.grid)] = self.grid
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k != "_spatial_plans"}
        new.__dict__.update(copy.deepcopy(state, memo))
        new._spatial_plans = {}
        return new


def check_axis_length(layer: str, axis: int, n: int, parts: int) -> None:
    """A grid axis longer than the dimension leaves a rank with nothing: refuse."""
    if n < parts:
        raise LayerError(f"{layer}: the grid has {parts} ranks on axis {AXIS_NAMES[axis]} but the "
                         f"input is only {n} long there; use at most {n} ranks on "
                         f"{AXIS_NAMES[axis]} or gather the volume first")


def triple(v, what: str, layer: str) -> tuple[int, int, int]:
    """torch's int-or-3-tuple argument convention."""
    if isinstance(v, int):
        return (v, v, v)
    v = tuple(v)
    if len(v) != 3:
        raise LayerError(f"{layer}: {what} must be an int or 3 ints, got {v}")
    return xyz(int(i) for i in v)
