"""The one geometry of hpcpar: how N items are split over P parts, and which inputs a stencil
(convolution, pooling, transposed convolution) needs for the outputs a rank owns.

Used by the halo plans, by the HDF5 hyperslab reader and by graph partitions, so all of them
agree on who owns what. All ranges are half-open ``[start, stop)`` in global coordinates.

Rule: N items over P parts, part i gets ``N // P + (1 if i < N % P else 0)`` items,
contiguous and in order. Every rank can derive every other rank's extent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

__all__ = ["split_sizes", "largest_piece", "part_range", "part_ranges", "box", "owner",
           "stencil_output_length", "live_taps", "MapWindow", "map_window",
           "stencil_input_range", "transposed_output_length", "transposed_input_range",
           "AxisHalo", "axis_halo", "conv_axis_halo", "transposed_axis_halo", "same_padding",
           "conv_pads", "ceil_div", "xyz", "torch_pad"]


def xyz(values: Iterable[T]) -> tuple[T, T, T]:
    """The (x, y, z) values of the three spatial axes as a 3-tuple: ``tuple(values)``, which
    the type checker cannot know has length three (ValueError if not three)."""
    x, y, z = values
    return x, y, z


def torch_pad(per_axis: Sequence[tuple[int, int]]) -> list[int]:
    """``(lo, hi)`` of the x, y, z axes as ``F.pad``'s list, which names the last axis first."""
    return [p for a in (2, 1, 0) for p in per_axis[a]]


def _check_parts(n: int, parts: int) -> None:
    if parts < 1:
        raise ValueError(f"number of parts must be positive, got {parts}")
    if n < 0:
        raise ValueError(f"number of items must be non-negative, got {n}")


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of the pieces of ``n`` items split over ``parts`` parts (the partition rule);
    ValueError when ``parts < 1`` or ``n < 0``."""
    _check_parts(n, parts)
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def largest_piece(shape: Sequence[int], parts: Sequence[int]) -> tuple[int, ...]:
    """Per axis, the extent of the largest piece of ``shape`` split ``parts`` ways (part 0's
    under the rule): the rank that runs out of memory or time first."""
    return tuple(max(split_sizes(n, p)) for n, p in zip(shape, parts))


def part_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The global items ``[start, stop)`` part ``index`` owns under the partition rule;
    ValueError when ``parts < 1``, ``n < 0`` or ``index`` is not in ``[0, parts)``."""
    _check_parts(n, parts)
    if not 0 <= index < parts:
        raise ValueError(f"part index {index} out of range for {parts} parts")
    q, r = divmod(n, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def part_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Every part's ``[start, stop)`` under the partition rule, in order."""
    return [part_range(n, parts, i) for i in range(parts)]


def box(shape: Sequence[int], parts: Sequence[int],
        index: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A rank's sub-volume, hyperslab or block: one ``(start, stop)`` per axis, the partition
    rule on every axis (``index``: the part's coordinate on each axis)."""
    return tuple(part_range(n, p, i) for n, p, i in zip(shape, parts, index))


def owner(n: int, parts: int, item: int) -> int:
    """The part that owns global ``item`` under the partition rule; ValueError when
    ``parts < 1``, ``n < 0`` or ``item`` is not in ``[0, n)``."""
    _check_parts(n, parts)
    if not 0 <= item < n:
        raise ValueError(f"item {item} out of range [0, {n})")
    q, r = divmod(n, parts)
    big = r * (q + 1)  # items held by the first r (larger) parts
    return item // (q + 1) if item < big else r + (item - big) // q


def stencil_output_length(n: int, kernel: int, stride: int = 1, pad_lo: int = 0,
                          pad_hi: int | None = None, dilation: int = 1,
                          ceil_mode: bool = False) -> int:
    """Global output length of a convolution or pooling window on one axis.

    ``M = floor((n + p_lo + p_hi - d(k-1) - 1) / s) + 1``; with ``ceil_mode`` (pools) the
    division rounds up, but the last window must start inside the input or left padding
    (torch's rule). ``pad_hi`` None is ``pad_lo``; 0 when the window does not fit.
    """
    pad_hi = pad_lo if pad_hi is None else pad_hi
    span = n + pad_lo + pad_hi - dilation * (kernel - 1) - 1
    if ceil_mode:
        # torch: floor((span + s - 1) / s) + 1, even for a window longer than the input
        m = (span + stride - 1) // stride + 1
        if (m - 1) * stride >= n + pad_lo:
            m -= 1
        return max(m, 0)
    if span < 0:
        return 0
    return span // stride + 1


def stencil_input_range(out_start: int, out_stop: int, kernel: int, stride: int = 1,
                        pad_lo: int = 0, dilation: int = 1) -> tuple[int, int]:
    """Global inputs read by a range of outputs of a convolution or pool, unclipped.

    Output o reads inputs ``s*o - p_lo + d*t`` for t in ``[0, k)``; positions outside
    ``[0, N)`` are padding. Half-open; ``(start, start)`` for an empty output range.
    """
    start = stride * out_start - pad_lo
    if out_stop <= out_start:
        return start, start
    return start, stride * (out_stop - 1) - pad_lo + dilation * (kernel - 1) + 1


def transposed_output_length(n: int, kernel: int, stride: int = 1, padding: int = 0,
                             output_padding: int = 0, dilation: int = 1) -> int:
    """Global output length of a transposed convolution on one axis (torch's formula):
    ``(n - 1)*s - 2p + d(k - 1) + output_padding + 1``."""
    return (n - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def transposed_input_range(out_start: int, out_stop: int, kernel: int, stride: int = 1,
                           padding: int = 0, dilation: int = 1) -> tuple[int, int]:
    """Inputs that contribute to a range of outputs of a transposed convolution, unclipped.

    Output o receives input i when ``o = s*i - p + d*t``, t in ``[0, k)``, so for owned
    outputs ``[a, b]`` i ranges over ``ceil((a + p - d(k-1)) / s) .. floor((b + p) / s)``.
    Half-open; ``(0, 0)`` for an empty output range.
    """
    if out_stop <= out_start:
        return 0, 0
    a, b = out_start, out_stop - 1
    lo = -((-(a + padding - dilation * (kernel - 1))) // stride)  # ceil division
    hi = (b + padding) // stride
    return lo, hi + 1


@dataclass(frozen=True)
class AxisHalo:
    """What one rank needs along one axis for one stencil layer (global coordinates).

    ``owned`` and ``out`` are its input and output ranges; ``needed`` the inputs its outputs
    read, clipped to ``[0, n_in)`` (empty when they read only padding). ``halo_lo``/``halo_hi``:
    items to receive from the lower/upper neighbours' data (negative: owned items nobody needs,
    to trim); ``pad_lo``/``pad_hi``: padding this rank adds itself (only on the global boundary).
    """

    n_in: int
    n_out: int
    owned: tuple[int, int]
    out: tuple[int, int]
    needed: tuple[int, int]
    halo_lo: int
    halo_hi: int
    pad_lo: int
    pad_hi: int


def axis_halo(n_in: int, n_out: int, parts: int, index: int,
              needed_for: Callable[[int, int], tuple[int, int]]) -> AxisHalo:
    """The halo of one part along one axis, from output ownership.

    The output is split with the partition rule; the input partition is the partition rule
    applied to ``n_in`` (the output partition of the previous layer). ``needed_for`` maps
    ``(out_start, out_stop)`` to the unclipped inputs ``(start, stop)`` those outputs read.
    """
    owned = part_range(n_in, parts, index)
    out = part_range(n_out, parts, index)
    start, stop = needed_for(*out)
    nothing = (owned[0], owned[0])
    if out[1] <= out[0] or stop <= start:
        # Owns no output, or its outputs read no input (transposed-conv gaps): needs nothing,
        # trims everything it owns.
        return AxisHalo(n_in, n_out, owned, out, nothing, -(owned[1] - owned[0]), 0, 0, 0)
    pad_lo = max(0, min(stop, 0) - start)       # positions < 0 in [start, stop)
    pad_hi = max(0, stop - max(start, n_in))    # positions >= n_in
    c_start, c_stop = max(start, 0), min(stop, n_in)
    if c_stop <= c_start:
        # Windows entirely in the padding (padding wider than the kernel's reach).
        return AxisHalo(n_in, n_out, owned, out, nothing, -(owned[1] - owned[0]), 0, pad_lo,
                        pad_hi)
    return AxisHalo(n_in, n_out, owned, out, (c_start, c_stop), owned[0] - c_start,
                    c_stop - owned[1], pad_lo, pad_hi)


def conv_axis_halo(n_in: int, parts: int, index: int, kernel: int, stride: int = 1,
                   pad_lo: int = 0, pad_hi: int | None = None, dilation: int = 1,
                   ceil_mode: bool = False) -> AxisHalo:
    """The :func:`axis_halo` of part ``index`` for a convolution or pooling window
    (``pad_hi`` None is ``pad_lo``; ``ceil_mode``: round the output length up, pools)."""
    n_out = stencil_output_length(n_in, kernel, stride, pad_lo, pad_hi, dilation, ceil_mode)
    return axis_halo(n_in, n_out, parts, index,
                     lambda a, b: stencil_input_range(a, b, kernel, stride, pad_lo, dilation))


def transposed_axis_halo(n_in: int, parts: int, index: int, kernel: int, stride: int = 1,
                         padding: int = 0, output_padding: int = 0,
                         dilation: int = 1) -> AxisHalo:
    """The :func:`axis_halo` of part ``index`` for a transposed convolution."""
    n_out = transposed_output_length(n_in, kernel, stride, padding, output_padding, dilation)
    return axis_halo(n_in, n_out, parts, index,
                     lambda a, b: transposed_input_range(a, b, kernel, stride, padding,
                                                         dilation))


def same_padding(kernel: int, dilation: int = 1) -> tuple[int, int]:
    """torch's ``padding="same"`` ``(low, high)`` for stride 1: the extra goes on the high side."""
    total = dilation * (kernel - 1)
    return total // 2, total - total // 2


def conv_pads(padding: str | int | Sequence[int], axis: int, kernel: int,
              dilation: int = 1) -> tuple[int, int]:
    """``(low, high)`` padding on ``axis`` of a conv's ``padding`` argument (``"same"``,
    ``"valid"``, an int or one int per axis; torch's meanings)."""
    if isinstance(padding, str):  # torch's modules accept only "same" and "valid"
        return same_padding(kernel, dilation) if padding == "same" else (0, 0)
    p = padding if isinstance(padding, int) else padding[axis]
    return p, p


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0`` in exact integer arithmetic (no float rounding)."""
    return -(-a // b)


def live_taps(n: int, k: int, s: int, d: int, lo: int, hi: int,
              outs: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """``(first, last)`` taps of a stencil along an axis of global length ``n`` (kernel ``k``,
    stride ``s``, dilation ``d``, padding ``lo``/``hi``) that read input data for some
    output (of ``outs = (start, stop)`` when given, else of all), or None (no output, or no
    tap reads data): the taps outside only ever read the padding (:mod:`hpcpar.nn._tap_trim`)."""
    span = n + lo + hi - d * (k - 1) - 1
    if span < 0:
        return None
    first_out, last_out = (0, span // s) if outs is None else \
        (outs[0], min(span // s, outs[1] - 1))

    def reads_data(t: int) -> bool:
        first = max(first_out, ceil_div(lo - t * d, s))  # the first output reading index >= 0
        return first <= last_out and first * s - lo + t * d < n

    live = [t for t in range(k) if reads_data(t)]
    return (live[0], live[-1]) if live else None


@dataclass(frozen=True)
class MapWindow:
    """One axis of what a rank's outputs ``[o0, o1)`` of a zero-padded stencil read from the
    whole map: the taps ``[t0, t1)`` that read the map for them, the map's items they read
    (``box``), the padding beyond the map's edge below and above, and ``count = o1 - o0``."""

    taps: tuple[int, int]
    box: tuple[int, int]
    pads: tuple[int, int]
    count: int


def map_window(out: tuple[int, int], n: int, k: int, s: int, d: int, lo: int,
               hi: int) -> MapWindow:
    """The :class:`MapWindow` of outputs ``out`` (not empty, some tap reading data) of a
    stencil on an axis of length ``n`` (kernel ``k``, stride ``s``, dilation ``d``, padding
    ``lo``/``hi``)."""
    taps = live_taps(n, k, s, d, lo, hi, out)
    assert taps is not None, (out, n, k, s, d, lo, hi)
    t0, t1 = taps[0], taps[1] + 1
    start, stop = stencil_input_range(*out, t1 - t0, s, lo - t0 * d, d)
    return MapWindow((t0, t1), (max(start, 0), min(stop, n)),
                     (max(-start, 0), max(stop - n, 0)), out[1] - out[0])
