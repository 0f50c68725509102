"""Leaving the partitioned world: after these layers every rank of a spatial group holds the
same (replicated) tensor, and the layers that follow run redundantly on each of them.

Convention (the conjugate pair): ``SpatialGather`` is all-gather forward / own-slice backward;
``SpatialAdaptiveAvgPool3d(1)`` is allreduce-mean forward / identity (broadcast) backward. The
loss computed after them is the same on every spatial rank and counts ONCE, so the gradient
flowing back into the partitioned part is each rank's slice, not a sum over ranks.

Parameters of layers after a gather are complete on every rank: tag them with
:func:`hpcpar.sync.tags.tag_data_only` (``spatialize`` does) so the gradient sync does not sum
them over the spatial group. Random layers there must draw the same numbers on every spatial
rank: :class:`ReplicatedDropout` does.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.primitives import GatherVolume, ReplicatedSum

from ._base import SpatialModule
from ._functional import acc_dtype
from .split import unwrap

__all__ = ["GatherPoint", "SpatialGather", "gather_shrunk", "SpatialAdaptiveAvgPool3d",
           "ReplicatedDropout"]


class GatherPoint(nn.Identity):
    """No-op marker in a plain model: "the tensor is gathered here". ``spatialize`` turns it
    into :class:`SpatialGather`; single-process it does nothing."""

    replicates = True

    def spatial_twin(self, grid: ProcessGrid) -> nn.Module:
        """The ``SpatialGather`` that ``spatialize`` puts in its place."""
        return SpatialGather(grid)


def gather_shrunk(t: torch.Tensor) -> torch.Tensor:
    """A split tensor shorter than its ranks on a split axis (:attr:`Layout.shrunk
    <hpcpar.nn.split.Layout.shrunk>`), whole and replicated on every rank of the spatial
    group: what an op that cannot run on such pieces takes instead (:mod:`hpcpar.nn.dispatch`).
    Its split dims may sit anywhere (a channels-last permute); backward is the own slice."""
    lay = t._hp  # type: ignore[attr-defined]
    ends = tuple(range(-len(lay.sdims), 0))
    piece = unwrap(t).movedim(lay.sdims, ends)
    return GatherVolume.apply(piece, lay.ctx.grid).movedim(ends, lay.sdims)


class SpatialGather(SpatialModule, nn.Module):
    """All-gather the partitioned ``(N, C, D, H, W)`` tensor into the full tensor on every rank
    of the spatial group (``grid.spatial_comm``); backward returns the rank's own slice of the
    gradient."""

    replicates = True

    def __init__(self, grid: ProcessGrid):
        nn.Module.__init__(self)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.grid.spatial_size == 1 else GatherVolume.apply(x, self.grid)


def global_mean(x: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """The mean over the last three dims of the whole volume, ``(..., 1, 1, 1)``, replicated:
    one :class:`~hpcpar.parallel.primitives.ReplicatedSum` of the pieces' sums and counts (in
    float64: counts above 2**24 stay exact), so backward is the gradient / count, no message."""
    acc = acc_dtype(x.dtype)
    sums = x.sum(dim=(-3, -2, -1), dtype=acc).reshape(-1).double()
    counted = torch.cat([sums, sums.new_full((1,), float(math.prod(x.shape[-3:])))])
    total = ReplicatedSum.apply(counted, grid.spatial_comm)
    return (total[:-1] / total[-1].item()).to(x.dtype).view(*x.shape[:-3], 1, 1, 1)


class SpatialAdaptiveAvgPool3d(SpatialModule, nn.AdaptiveAvgPool3d):
    """``nn.AdaptiveAvgPool3d(1)`` over the whole (partitioned) volume: the mean over all voxels of
    the spatial group, replicated on every rank. ``output_size`` must be 1 (or ``(1, 1, 1)``):
    LayerError otherwise."""

    replicates = True

    def __init__(self, output_size: int | tuple[int, int, int] = 1, *, grid: ProcessGrid):
        sizes = (output_size,) * 3 if not isinstance(output_size, (tuple, list)) else output_size
        if tuple(sizes) != (1, 1, 1):
            raise LayerError(f"SpatialAdaptiveAvgPool3d: output_size {output_size!r} is not "
                             "supported, only 1 (a global pool); put hpcpar.nn.SpatialGather "
                             "before other adaptive pools")
        nn.AdaptiveAvgPool3d.__init__(self, output_size)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (4, 5):
            raise LayerError(f"SpatialAdaptiveAvgPool3d: expected a 4D or 5D input, got "
                             f"shape {tuple(x.shape)}")
        return global_mean(x, self.grid)


class ReplicatedDropout(nn.Module):
    """Dropout whose masks are identical on every rank of a spatial group (and differ between
    data groups), so replicated layers stay replicated. ``feature=True`` drops whole channels
    (``Dropout3d``), which is also correct on a partitioned tensor.

    The generator is seeded once from the spatial root (collective at construction)."""

    def __init__(self, p: float = 0.5, *, grid: ProcessGrid, feature: bool = False,
                 inplace: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.feature, self.inplace = p, feature, inplace
        seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = grid.spatial_comm.bcast(seed, root=0) + 1_000_003 * grid.coords[0]
        self._generators: dict = {}

    def _generator(self, device):
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        shape = (*x.shape[:2], *([1] * (x.dim() - 2))) if self.feature else x.shape
        keep = torch.empty(shape, dtype=x.dtype, device=x.device)
        keep.bernoulli_(1.0 - self.p, generator=self._generator(x.device))
        keep.div_(1.0 - self.p)
        return x.mul_(keep) if self.inplace else x * keep

    def extra_repr(self) -> str:
        return f"p={self.p}, feature={self.feature}, seed={self.seed}"
