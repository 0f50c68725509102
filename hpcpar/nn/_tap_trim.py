"""Kernel taps that only ever read zero padding, dropped exactly.

Along an axis of global length ``n``, tap ``t`` of a zero-padded convolution (kernel ``k``, stride
``s``, dilation ``d``, padding ``lo``/``hi``) reads input ``i*s - lo + t*d`` for each output ``i``.
A tap whose every read falls outside ``[0, n)`` only ever multiplies zeros: the convolution with the
kernel cut to the taps that can read data (padding lowered by the dropped taps' reach) has the same
outputs, and its weight's gradient at the dropped taps is torch's own, zero. What it saves is the
halo: DeepLabV3's ASPP (dilation = padding 12..36 on a map a few voxels wide) becomes a 1x1x1
convolution with nothing to exchange, where the full kernel would materialise a padded copy many
times the map on every rank. Decided from global sizes only, so every rank trims alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpar.parallel.partition import conv_pads, live_taps

__all__ = ["Trim", "tap_trim"]


@dataclass(frozen=True)
class Trim:
    """The equivalent convolution: weight ``w[taps]``, this kernel, padding and dilation."""
    taps: tuple[slice, ...]   # index of the weight (out, in, x, y, z)
    kernel: tuple[int, int, int]
    padding: tuple[int, int, int]
    dilation: tuple[int, int, int]


def tap_trim(gshape, kernel, stride, dilation, padding) -> Trim | None:
    """The trimmed geometry of a zero-padded convolution on global spatial shape ``gshape``,
    or None where no tap is dead on any axis or the result is not a torch convolution
    (padding that would turn negative or lopsided keeps today's route)."""
    taps, ks, pads, dils = [], [], [], []
    for a in range(3):
        k, d = kernel[a], dilation[a]
        lo, hi = conv_pads(padding, a, k, d)
        live = live_taps(gshape[a], k, stride[a], d, lo, hi)
        if live is None:
            return None
        t0, t1 = live
        lo2, hi2 = lo - t0 * d, hi - (k - 1 - t1) * d
        if lo2 != hi2 or lo2 < 0:
            return None
        taps.append(slice(t0, t1 + 1))
        ks.append(t1 - t0 + 1)
        pads.append(lo2)
        dils.append(d if t1 > t0 else 1)   # one tap: dilation is moot (and blocks fast routes)
    if tuple(ks) == tuple(kernel):
        return None
    return Trim((slice(None), slice(None), *taps), (ks[0], ks[1], ks[2]),
                (pads[0], pads[1], pads[2]), (dils[0], dils[1], dils[2]))
