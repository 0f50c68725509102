"""Dropout whose mask does not depend on how the volume is split.

torch's dropout draws its mask from a random stream in memory order, so a split run would drop
different voxels than one process. Here each keep/drop decision is a counter-based hash
(:mod:`hpcpar.nn._voxel_hash`) of the seed and the element's GLOBAL coordinates, so any grid gives
exactly (bit for bit) what one rank with the whole volume and the whole batch gives: hpcpar's own
dropout, with torch's probability and scaling (1/(1 - p)), not its random numbers. A voxel is
dropped when its 32-bit draw ``u < round(p·2³²)``: the rate is p to within 2⁻³².

Coordinates: global sample ``n_g = grid.coords[0] * N + n`` (the global batch is split evenly
over the data axis, data group d holding samples ``[d*N, (d+1)*N)``), channel ``c``, and unless
``feature`` (whole channels, ``Dropout3d``) the global voxel ``(d, h, w)``.

Backward regenerates the mask (nothing is saved): a bool mask would hold one byte per voxel from
forward to backward, and memory per rank is what limits the sample size, while the hash costs a few
ns per voxel (~4-7 ns/voxel in one thread on a 8x64³ float32 piece, against ~10-11 for torch's own
dropout; ~0.5 for whole channels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.spatial import local_shape, local_slices

from ._voxel_hash import VoxelCounter, low32, signed, splitmix64, stream_key

__all__ = ["spatial_dropout", "next_dropout_seed"]


def next_dropout_seed() -> int:
    """The seed of one dropout call, drawn from torch's default generator: it follows
    ``torch.manual_seed`` (so ranks that seeded alike agree) and successive calls differ."""
    return int(torch.randint(0, 2**62, ()).item())


@dataclass(frozen=True)
class _KeepMask:
    """The keep mask of one call on one rank's piece: a pure function of the global geometry,
    regenerated wherever it is applied (forward and backward)."""

    key: int                        # SplitMix64(seed), signed 64-bit
    threshold: int                  # drop when the unsigned 32-bit draw is below it
    scale: float                    # 1 / (1 - p)
    counter: VoxelCounter           # the piece's global coordinates
    feature: bool

    def _kept(self, draw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = draw >= threshold`` as unsigned 32-bit numbers (``draw`` is clobbered):
        flipping the sign bit of both sides makes torch's signed compare an unsigned one."""
        draw.bitwise_xor_(signed(1 << 31, 32))
        return torch.ge(draw, self.threshold - (1 << 31), out=out)

    def apply(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = t · keep · scale`` (``out`` may be ``t``)."""
        n, c = t.shape[:2]
        if self.feature:
            ids = (torch.arange(n, device=t.device) + self.counter.n0).view(n, 1) \
                * self.counter.radices[0]
            ids = ids + torch.arange(c, device=t.device)
            draw = low32(splitmix64(ids, self.key))
            kept = self._kept(draw, torch.empty(draw.shape, dtype=torch.bool, device=t.device))
            return torch.mul(t, kept.view(n, c, 1, 1, 1), out=out).mul_(self.scale)
        keep: torch.Tensor | None = None
        for planes, draw in self.counter.slabs(self.key, t):
            if keep is None:   # the first slab is the largest
                keep = torch.empty_like(draw, dtype=torch.bool)
            ks = keep[:, :, :draw.shape[2]]
            self._kept(draw, ks)
            torch.mul(t[:, :, planes], ks, out=out[:, :, planes]).mul_(self.scale)
        return out


class _SpatialDropout(torch.autograd.Function):
    """y = x·keep·scale; backward dx = dy·keep·scale with the mask regenerated."""

    @staticmethod
    def forward(ctx, x, mask, inplace):
        ctx.mask = mask
        if inplace:
            ctx.mark_dirty(x)
            return mask.apply(x, x)
        return mask.apply(x, torch.empty_like(x))

    @staticmethod
    def backward(ctx, grad):
        return ctx.mask.apply(grad, torch.empty_like(grad)), None, None


def spatial_dropout(x: torch.Tensor, p: float, training: bool = True, inplace: bool = False,
                    *, grid: ProcessGrid, gshape: Sequence[int], feature: bool,
                    seed: int) -> torch.Tensor:
    """Dropout of this rank's piece with a mask that depends only on the seed and global
    coordinates: any grid gives what one rank with the whole tensor gives.

    ``x`` is this rank's float piece of the global ``(N, C, *gshape)`` tensor (either memory format;
    the output keeps it); ``p`` the probability of dropping an element (or, with ``feature``, a
    whole channel: ``Dropout3d``); ``training`` False is the identity, as in ``F.dropout``; the
    grid's data coordinate numbers the samples; ``seed`` is the call's, the same on every rank (e.g.
    :func:`next_dropout_seed`). Dropped elements are zeroed, kept ones scaled by ``1 / (1 - p)``.
    LayerError: ``p`` outside [0, 1], a non-float or non-5D input, or a piece whose shape is not
    this rank's piece of ``gshape``."""
    kind = "Dropout3d" if feature else "Dropout"
    if not 0.0 <= p <= 1.0:
        raise LayerError(f"spatial {kind}: dropout probability has to be between 0 and 1, "
                         f"got {p}")
    if x.dim() != 5 or not x.dtype.is_floating_point:
        raise LayerError(f"spatial {kind}: expected a 5D float (N, C, D, H, W) piece, got "
                         f"shape {tuple(x.shape)} {x.dtype}")
    glob = (*x.shape[:2], *(int(s) for s in gshape))
    if len(gshape) != 3 or tuple(x.shape) != local_shape(glob, grid):
        raise LayerError(f"spatial {kind}: input {tuple(x.shape)} is not this rank's piece "
                         f"of global spatial shape {tuple(gshape)} on grid {grid.spec()}")
    threshold = round(p * 2**32)
    if not training or threshold == 0:
        return x
    if threshold >= 2**32:   # p = 1 (to 32 bits): torch's rule, x·0
        return x.mul_(0.0) if inplace else x * 0.0
    offsets = tuple(s.start for s in local_slices(glob, grid)[2:])
    mask = _KeepMask(stream_key(seed), threshold, 1.0 / (1.0 - p),
                     VoxelCounter(grid.coords[0] * x.shape[0], glob[1:4], offsets), feature)
    return _SpatialDropout.apply(x, mask, inplace)
