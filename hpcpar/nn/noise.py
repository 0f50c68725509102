"""Random numbers shaped like a split volume that do not depend on how it is split.

``torch.randn_like(x)``, ``torch.rand_like(x)``, ``x.normal_()`` and ``x.uniform_()`` on a split
``x`` (a VAE sampling its latent volume, noise injected into a feature map, ``nn.init`` on a volume)
would draw each rank's piece from its own generator in memory order: different numbers than one
process, and different again on another grid. Here every element's numbers are a hash of the call's
seed and the element's GLOBAL coordinates (:mod:`hpcpar.nn._voxel_hash`, as hpcpar's dropout), so
any grid, data width included, gives bit for bit what one rank with the whole tensor and the whole
batch gives. These are hpcpar's numbers, not torch's: the same distributions, other draws.

Uniform numbers are 32-bit (``k / 2³²``, kept below 1 in the output's precision); normal ones
come from two independent 32-bit uniforms by the Box-Muller transform in float64 (tails to
about 6.7 standard deviations).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.spatial import local_slices

from ._voxel_hash import VoxelCounter, stream_key

__all__ = ["spatial_noise"]

_TWO32 = 2.0 ** 32


def _unsigned(draw: torch.Tensor) -> torch.Tensor:
    """Signed int32 draws as their unsigned values, in float64 (exact)."""
    return draw.to(torch.float64).add_(_TWO32).remainder_(_TWO32)


def spatial_noise(piece: torch.Tensor, kind: str, *, grid: ProcessGrid, sdims: Sequence[int],
                  gshape: Sequence[int], seed: int,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Numbers for this rank's ``piece`` of a global tensor: standard normal (``"normal"``) or
    uniform on [0, 1) (``"uniform"``): a new tensor shaped like ``piece``, in its memory format
    (``dtype`` default: ``piece``'s). Only the piece's shape, device and memory format are used; its
    dim 0 is the batch, split evenly over the data axis, and its dims ``sdims`` (global lengths
    ``gshape``) lie along the grid's x, y and z axes. ``seed`` is the same on every rank."""
    dtype = dtype or piece.dtype
    rest = [d for d in range(1, piece.dim()) if d not in sdims]
    order = [0, *rest, *sdims]
    moved = piece.permute(order)
    n, chans = moved.shape[0], math.prod(moved.shape[1:1 + len(rest)])
    d, h, w = moved.shape[-3:]
    glob = (n, chans, *gshape)
    offsets = tuple(s.start for s in local_slices(glob, grid)[2:])
    counter = VoxelCounter(grid.coords[0] * n, (chans, gshape[0], gshape[1]), offsets)
    out = torch.empty((n, chans, d, h, w), dtype=dtype, device=piece.device)
    if kind == "uniform":
        below_one = torch.nextafter(torch.ones((), dtype=dtype), torch.zeros((), dtype=dtype))
        for planes, draw in counter.slabs(stream_key(seed, 1), out):
            u = _unsigned(draw).div_(_TWO32).to(dtype)
            out[:, :, planes] = u.clamp_(max=below_one)
    else:
        for (planes, a), (_, b) in zip(counter.slabs(stream_key(seed, 1), out),
                                       counter.slabs(stream_key(seed, 2), out)):
            radius = _unsigned(a).add_(0.5).div_(_TWO32).log_().mul_(-2.0).sqrt_()
            angle = _unsigned(b).mul_(2.0 * math.pi / _TWO32).cos_()
            out[:, :, planes] = radius.mul_(angle)
    out = out.view(moved.shape).permute([order.index(i) for i in range(piece.dim())])
    like = torch.empty_like(piece, dtype=dtype)   # the piece's memory format
    return out if out.stride() == like.stride() else like.copy_(out)
