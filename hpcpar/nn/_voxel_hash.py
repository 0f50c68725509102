"""Counter-based random draws keyed by GLOBAL coordinates: the same numbers on any split.

torch's generators fill a tensor in memory order, so a split run would draw different numbers for a
voxel than one process. Here each draw is a hash of a call's key and the element's global
coordinates (hpcpar's own dropout and noise use it): global sample ``n_g``, channel ``c`` (any
non-split dims, flattened) and voxel ``(d, h, w)``. The row ``r = ((n_g·C + c)·D + d)·H + h`` takes
output r of the SplitMix64 stream of the key, truncated to 32 bits; voxel w of the row is murmur3's
32-bit finaliser of ``row + w·0x9E3779B9`` (a bijection per row, so no two voxels of a row share a
draw). 64-bit work per row, 32-bit per voxel: int64 multiplies have no SIMD instruction on most
CPUs. Voxels are hashed in slabs of planes, so the temporaries are ~1 MB plus 12 bytes per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

SLAB = 1 << 18  # voxels per slab of hashing work


def signed(value: int, bits: int) -> int:
    """The two's complement reading of ``value`` mod 2**bits (torch ints are signed)."""
    value %= 1 << bits
    return value - (1 << bits) if value >> (bits - 1) else value


GAMMA64 = signed(0x9E3779B97F4A7C15, 64)
GAMMA32 = signed(0x9E3779B9, 32)
_SPLITMIX = ((30, signed(0xBF58476D1CE4E5B9, 64)), (27, signed(0x94D049BB133111EB, 64)),
             (31, None))
FMIX32 = ((16, signed(0x85EBCA6B, 32)), (13, signed(0xC2B2AE35, 32)), (16, None))


def finalise_(z: torch.Tensor, steps, bits: int, tmp: torch.Tensor) -> torch.Tensor:
    """z ^= z >>> s; z *= m, for each (s, m), in place with wrapping integer arithmetic (``>>>`` is
    the logical shift: torch's ``>>`` is arithmetic, so the sign copies are masked off)."""
    for shift, mult in steps:
        torch.bitwise_right_shift(z, shift, out=tmp).bitwise_and_((1 << (bits - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(mult)
    return z


def splitmix64(counters: torch.Tensor, key: int) -> torch.Tensor:
    """Output ``counters`` of the SplitMix64 stream seeded ``key`` (int64 tensor)."""
    z = (counters + 1).mul_(GAMMA64).add_(key)
    return finalise_(z, _SPLITMIX, 64, torch.empty_like(z))


def low32(z: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of an int64 tensor, as int32 (exact, no overflowing cast)."""
    return z.bitwise_and(0xFFFFFFFF).bitwise_xor_(1 << 31).sub_(1 << 31).to(torch.int32)


def stream_key(seed: int, stream: int = 0) -> int:
    """The key of stream ``stream`` of a call's ``seed`` (independent streams of one call)."""
    return int(splitmix64(torch.tensor(signed(seed, 64)), stream).item())


@dataclass(frozen=True)
class VoxelCounter:
    """Where one rank's ``(n, c, d, h, w)`` piece sits in the global tensor."""

    n0: int                         # global index of this piece's first sample
    radices: tuple[int, int, int]   # global (C, D, H): the row counter's radices
    offsets: tuple[int, int, int]   # global (d, h, w) of this piece's first voxel

    def rows(self, n: int, c: int, d: int, h: int, device) -> torch.Tensor:
        """Global row counters ``((n_g·C + c)·D + d)·H + h`` of the piece, (n, c, d, h, 1)."""
        C, D, H = self.radices
        d0, h0, _ = self.offsets
        ar = [torch.arange(k, dtype=torch.int64, device=device) for k in (n, c, d, h)]
        sample = ((ar[0] + self.n0) * C).view(n, 1, 1, 1, 1) + ar[1].view(1, c, 1, 1, 1)
        return ((sample * D + (ar[2] + d0).view(1, 1, d, 1, 1)) * H
                + (ar[3] + h0).view(1, 1, 1, h, 1))

    def slabs(self, key: int, like: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(planes, draws)`` over the piece shaped like ``like``: the signed int32 draws of
        ``like[:, :, planes]`` (in ``like``'s memory format), valid until the next slab."""
        n, c, d, h, w = like.shape
        rows = low32(splitmix64(self.rows(n, c, d, h, like.device), key))
        cols = (torch.arange(w, device=like.device) + self.offsets[2]).mul_(GAMMA32)
        cols = low32(cols).view(1, 1, 1, 1, w)
        step = max(1, SLAB // max(1, n * c * h * w))
        z = torch.empty_like(like[:, :, :step], dtype=torch.int32)
        tmp = torch.empty_like(z)
        for a in range(0, d, step):
            planes = slice(a, min(a + step, d))
            k = planes.stop - a
            zs = z[:, :, :k]
            torch.add(rows[:, :, planes], cols, out=zs)
            yield planes, finalise_(zs, FMIX32, 32, tmp[:, :, :k])
