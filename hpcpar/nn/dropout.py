"""Dropout whose mask does not depend on how the volume is split.

torch's dropout draws its mask from a random stream in memory order, so a split run would drop
different voxels than one process. Here each keep/drop decision is a counter-based hash of the
seed and the element's GLOBAL coordinates, so any grid gives exactly (bit for bit) what one rank
with the whole volume and the whole batch gives. This is hpcpar's own dropout: the same
probability and scaling as torch's, not torch's random numbers.

Coordinates: global sample ``n_g = grid.coords[0] * N + n`` (the global batch is split evenly
over the data axis, data group d holding samples ``[d*N, (d+1)*N)``), channel ``c``, and unless
``feature`` (whole channels, ``Dropout3d``) the global voxel ``(d, h, w)``.

Hash: the row ``r = ((n_g·C + c)·D + d)·H + h`` takes output r of the SplitMix64 stream of
``key = SplitMix64(seed)``, truncated to 32 bits; voxel w of the row is murmur3's 32-bit finaliser
of ``row + w·0x9E3779B9`` (a bijection per row, so no two voxels of a row share a draw). 64-bit
work per row, 32-bit per voxel: int64 multiplies have no SIMD instruction on most CPUs. The
voxel is dropped when its 32-bit draw ``u < round(p·2³²)``, so the rate is p to within 2⁻³².
Kept values are scaled by 1/(1 - p).

Backward regenerates the mask (nothing is saved): a bool mask would hold one byte per voxel
from forward to backward, and memory per rank is what limits the sample size, while the hash
costs a few ns per voxel (~4-7 ns/voxel in one thread on a 8x64³ float32 piece, against
~10-11 for torch's own dropout measured the same way; ~0.5 for whole channels). Voxels are
hashed in slabs of planes, so the temporaries are ~1 MB plus 12 bytes per row of w voxels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.spatial import local_shape, local_slices

__all__ = ["spatial_dropout", "next_dropout_seed"]

_SLAB = 1 << 18  # voxels per slab of hashing work


def _signed(value: int, bits: int) -> int:
    """The two's complement reading of ``value`` mod 2**bits (torch ints are signed)."""
    value %= 1 << bits
    return value - (1 << bits) if value >> (bits - 1) else value


_GAMMA64 = _signed(0x9E3779B97F4A7C15, 64)
_GAMMA32 = _signed(0x9E3779B9, 32)
_SPLITMIX = ((30, _signed(0xBF58476D1CE4E5B9, 64)), (27, _signed(0x94D049BB133111EB, 64)),
             (31, None))
_FMIX32 = ((16, _signed(0x85EBCA6B, 32)), (13, _signed(0xC2B2AE35, 32)), (16, None))


def _finalise_(z: torch.Tensor, steps, bits: int, tmp: torch.Tensor) -> torch.Tensor:
    """z ^= z >>> s; z *= m, for each (s, m), in place with wrapping integer arithmetic
    (``>>>`` is the logical shift: torch's ``>>`` is arithmetic, so the sign copies are
    masked off)."""
    for shift, mult in steps:
        torch.bitwise_right_shift(z, shift, out=tmp).bitwise_and_((1 << (bits - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(mult)
    return z


def _splitmix64(counters: torch.Tensor, key: int) -> torch.Tensor:
    """Output ``counters`` of the SplitMix64 stream seeded ``key`` (int64 tensor)."""
    z = (counters + 1).mul_(_GAMMA64).add_(key)
    return _finalise_(z, _SPLITMIX, 64, torch.empty_like(z))


def _low32(z: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of an int64 tensor, as int32 (exact, no overflowing cast)."""
    return z.bitwise_and(0xFFFFFFFF).bitwise_xor_(1 << 31).sub_(1 << 31).to(torch.int32)


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
    n0: int                         # global index of this piece's first sample
    radices: tuple[int, int, int]   # global (C, D, H): the row counter's radices
    offsets: tuple[int, int, int]   # global (d, h, w) of this piece's first voxel
    feature: bool

    def _kept(self, draw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = draw >= threshold`` as unsigned 32-bit numbers (``draw`` is clobbered):
        flipping the sign bit of both sides makes torch's signed compare an unsigned one."""
        draw.bitwise_xor_(_signed(1 << 31, 32))
        return torch.ge(draw, self.threshold - (1 << 31), out=out)

    def _rows(self, n: int, c: int, d: int, h: int, device) -> torch.Tensor:
        """Global row counters ``((n_g·C + c)·D + d)·H + h`` of the piece, (n, c, d, h, 1)."""
        C, D, H = self.radices
        d0, h0, _ = self.offsets
        ar = [torch.arange(k, dtype=torch.int64, device=device) for k in (n, c, d, h)]
        sample = ((ar[0] + self.n0) * C).view(n, 1, 1, 1, 1) + ar[1].view(1, c, 1, 1, 1)
        return ((sample * D + (ar[2] + d0).view(1, 1, d, 1, 1)) * H
                + (ar[3] + h0).view(1, 1, 1, h, 1))

    def apply(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = t · keep · scale`` (``out`` may be ``t``)."""
        n, c, d, h, w = t.shape
        if self.feature:
            ids = (torch.arange(n, device=t.device) + self.n0).view(n, 1) * self.radices[0]
            ids = ids + torch.arange(c, device=t.device)
            draw = _low32(_splitmix64(ids, self.key))
            keep = self._kept(draw, torch.empty(draw.shape, dtype=torch.bool, device=t.device))
            return torch.mul(t, keep.view(n, c, 1, 1, 1), out=out).mul_(self.scale)
        rows = _low32(_splitmix64(self._rows(n, c, d, h, t.device), self.key))
        cols = (torch.arange(w, device=t.device) + self.offsets[2]).mul_(_GAMMA32)
        cols = _low32(cols).view(1, 1, 1, 1, w)
        step = max(1, _SLAB // max(1, n * c * h * w))
        first = t[:, :, :step]
        z = torch.empty_like(first, dtype=torch.int32)   # t's memory format
        tmp, keep = torch.empty_like(z), torch.empty_like(z, dtype=torch.bool)
        for a in range(0, d, step):
            planes = slice(a, min(a + step, d))
            k = min(step, d - a)
            zs, ts, ks = z[:, :, :k], tmp[:, :, :k], keep[:, :, :k]
            torch.add(rows[:, :, planes], cols, out=zs)
            self._kept(_finalise_(zs, _FMIX32, 32, ts), ks)
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

    Args:
        x: This rank's piece ``(N, C, d, h, w)`` of the global ``(N, C, *gshape)`` tensor
            (float, either memory format; the output keeps it).
        p: Probability of dropping an element (or channel), ``0 <= p <= 1``.
        training: Apply dropout (identity when False), as torch's ``F.dropout``.
        inplace: Write the result into ``x``.
        grid: The process grid (its data coordinate numbers the samples).
        gshape: The global spatial shape ``(D, H, W)``.
        feature: Drop whole channels (``Dropout3d``) instead of single voxels (``Dropout``).
        seed: The call's seed, the same on every rank (e.g. :func:`next_dropout_seed`).

    Returns:
        ``x`` with dropped elements zeroed and kept ones scaled by ``1 / (1 - p)``.

    Raises:
        LayerError: ``p`` outside [0, 1], a non-float or non-5D input, or a piece whose shape
            is not this rank's piece of ``gshape``.
    """
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
    key = int(_splitmix64(torch.tensor(_signed(seed, 64)), 0).item())
    offsets = tuple(s.start for s in local_slices(glob, grid)[2:])
    mask = _KeepMask(key, threshold, 1.0 / (1.0 - p), grid.coords[0] * x.shape[0],
                     glob[1:4], offsets, feature)
    return _SpatialDropout.apply(x, mask, inplace)
