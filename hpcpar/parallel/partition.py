"""The one geometry of hpcpar: how N items are split over P parts, and which inputs a stencil
(convolution, pooling, transposed convolution) needs for the outputs a rank owns.

Used by the halo plans, by the HDF5 hyperslab reader and by graph partitions, so all of them
agree on who owns what. All ranges are half-open ``[start, stop)`` in global coordinates.

Rule: N items over P parts, part i gets ``N // P + (1 if i < N % P else 0)`` items,
contiguous and in order. Every rank can derive every other rank's extent.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_parts(n: int, parts: int) -> None:
    if parts < 1:
        raise ValueError(f"number of parts must be positive, got {parts}")
    if n < 0:
        raise ValueError(f"number of items must be non-negative, got {n}")


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of the ``parts`` pieces of ``n`` items (the partition rule)."""
    _check_parts(n, parts)
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def part_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Global ``[start, stop)`` owned by part ``index``."""
    _check_parts(n, parts)
    if not 0 <= index < parts:
        raise ValueError(f"part index {index} out of range for {parts} parts")
    q, r = divmod(n, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def part_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """All parts' ``[start, stop)`` ranges, in order."""
    return [part_range(n, parts, i) for i in range(parts)]


def box(shape, parts, index) -> tuple[tuple[int, int], ...]:
    """Per-axis ``[start, stop)`` of part ``index`` (a coordinate per axis) when each axis of
    ``shape`` is split into ``parts`` pieces: a rank's sub-volume, hyperslab or block."""
    return tuple(part_range(n, p, i) for n, p, i in zip(shape, parts, index))


def owner(n: int, parts: int, item: int) -> int:
    """The part that owns global item ``item``."""
    _check_parts(n, parts)
    if not 0 <= item < n:
        raise ValueError(f"item {item} out of range [0, {n})")
    q, r = divmod(n, parts)
    big = r * (q + 1)  # items held by the first r (larger) parts
    return item // (q + 1) if item < big else r + (item - big) // q


def stencil_output_length(n: int, kernel: int, stride: int = 1, pad_lo: int = 0,
                          pad_hi: int | None = None, dilation: int = 1,
                          ceil_mode: bool = False) -> int:
    """Global output length of a conv/pool on an axis of length ``n``.

    M = floor((n + p_lo + p_hi - d(k-1) - 1) / s) + 1; with ``ceil_mode`` (pools) the division
    rounds up, but the last window must start inside the input or left padding (torch's rule).
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
    """Global inputs ``[start, stop)`` read by outputs ``[out_start, out_stop)``, unclipped.

    Output o reads inputs s*o - p_lo + d*t for t in [0, k). Values outside [0, N) are padding.
    An empty output range needs no input: ``(start, start)``.
    """
    start = stride * out_start - pad_lo
    if out_stop <= out_start:
        return start, start
    return start, stride * (out_stop - 1) - pad_lo + dilation * (kernel - 1) + 1


def transposed_output_length(n: int, kernel: int, stride: int = 1, padding: int = 0,
                             output_padding: int = 0, dilation: int = 1) -> int:
    """Global output length of a transposed convolution (torch's formula)."""
    return (n - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def transposed_input_range(out_start: int, out_stop: int, kernel: int, stride: int = 1,
                           padding: int = 0, dilation: int = 1) -> tuple[int, int]:
    """Inputs ``[start, stop)`` that contribute to outputs ``[out_start, out_stop)`` of a
    transposed conv, unclipped: output o receives input i when o = s*i - p + d*t, t in [0, k),
    so i ranges over ceil((a + p - d(k-1)) / s) .. floor((b + p) / s) for owned [a, b].
    """
    if out_stop <= out_start:
        return 0, 0
    a, b = out_start, out_stop - 1
    lo = -((-(a + padding - dilation * (kernel - 1))) // stride)  # ceil division
    hi = (b + padding) // stride
    return lo, hi + 1


@dataclass(frozen=True)
class AxisHalo:
    """What one rank needs along one axis for one stencil layer.

    ``owned``: the rank's input range; ``out``: its output range; ``needed``: input range the
    outputs read, clipped to [0, n_in); ``halo_lo/halo_hi``: items to receive from the lower /
    upper neighbours' data (negative = owned items nobody needs: trim them); ``pad_lo/pad_hi``:
    padding items this rank adds itself (only ranks on the global boundary). When the owned
    outputs read only padding, ``needed`` is empty and the padding is all there is.
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
              needed_for, ) -> AxisHalo:
    """Halo of part ``index`` given ``needed_for(out_start, out_stop) -> (start, stop)``.

    The output is split with the partition rule; the input partition is the partition rule
    applied to ``n_in`` (the output partition of the previous layer).
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
    """:func:`axis_halo` for a convolution or pooling window."""
    n_out = stencil_output_length(n_in, kernel, stride, pad_lo, pad_hi, dilation, ceil_mode)
    return axis_halo(n_in, n_out, parts, index,
                     lambda a, b: stencil_input_range(a, b, kernel, stride, pad_lo, dilation))


def transposed_axis_halo(n_in: int, parts: int, index: int, kernel: int, stride: int = 1,
                         padding: int = 0, output_padding: int = 0,
                         dilation: int = 1) -> AxisHalo:
    """:func:`axis_halo` for a transposed convolution."""
    n_out = transposed_output_length(n_in, kernel, stride, padding, output_padding, dilation)
    return axis_halo(n_in, n_out, parts, index,
                     lambda a, b: transposed_input_range(a, b, kernel, stride, padding,
                                                         dilation))


def same_padding(kernel: int, dilation: int = 1) -> tuple[int, int]:
    """torch's padding='same' split for stride 1: extra padding goes on the high side."""
    total = dilation * (kernel - 1)
    return total // 2, total - total // 2


def conv_pads(padding, axis: int, kernel: int, dilation: int = 1) -> tuple[int, int]:
    """(low, high) padding on ``axis`` for a conv's ``padding`` argument: ``'same'``,
    ``'valid'``, an int or one int per axis (torch's meanings)."""
    if padding == "same":
        return same_padding(kernel, dilation)
    if padding == "valid":
        return 0, 0
    p = padding if isinstance(padding, int) else padding[axis]
    return p, p


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "split_sizes", "part_range", "part_ranges", "box", "owner", "stencil_output_length",
    "stencil_input_range", "transposed_output_length", "transposed_input_range", "AxisHalo",
    "axis_halo", "conv_axis_halo", "transposed_axis_halo", "same_padding", "conv_pads",
    "ceil_div",
]
