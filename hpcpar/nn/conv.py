"""Spatially partitioned 3D convolutions: torch's Conv3d / ConvTranspose3d plus ``grid=``.

Each rank convolves its own sub-volume extended by the halo (``padding=0`` on the explicitly
padded input: torch's CPU conv is faster that way, and only boundary ranks pad). Halo widths
come from output ownership (DESIGN §2), so any kernel/stride/padding/dilation is exact.
Weight and bias gradients are the partial gradients of this rank's outputs; the gradient
sync sums them over the spatial group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..halo import HaloError, StencilOp, halo_stencil
from ..partition import conv_axis_halo, same_padding, transposed_axis_halo
from ._base import SpatialModule


def _empty_out(ext, channels, lengths):
    return ext.new_zeros((ext.shape[0], channels, *lengths))


class ConvOp(StencilOp):
    """Valid (padding 0) convolution of the halo-extended tensor."""

    def __init__(self, stride, dilation, groups, out_channels, out_shape):
        self.stride, self.dilation, self.groups = stride, dilation, groups
        self.out_channels, self.out_shape = out_channels, out_shape

    def forward(self, ext, weight, bias=None):
        if 0 in self.out_shape:
            out = _empty_out(ext, self.out_channels, self.out_shape)
            return out
        return F.conv3d(ext, weight, bias, self.stride, 0, self.dilation, self.groups)

    def backward(self, ext, grad_out, params, needs):
        weight, bias = params
        if 0 in self.out_shape:
            return (torch.zeros_like(ext) if needs[0] else None,
                    torch.zeros_like(weight) if needs[1] else None,
                    torch.zeros_like(bias) if bias is not None and needs[2] else None)
        gi, gw, gb = torch.ops.aten.convolution_backward(
            grad_out, ext, weight, None if bias is None else [bias.shape[0]], self.stride,
            [0, 0, 0], self.dilation, False, [0, 0, 0], self.groups,
            [needs[0], needs[1], bias is not None and needs[2]])
        return gi, gw, gb


class SpatialConv3d(SpatialModule, nn.Conv3d):
    """``torch.nn.Conv3d`` over a volume split on the grid's x, y, z axes (dims 2, 3, 4)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 dilation=1, groups=1, bias=True, padding_mode="zeros", device=None,
                 dtype=None, *, grid):
        nn.Conv3d.__init__(self, in_channels, out_channels, kernel_size, stride, padding,
                           dilation, groups, bias, padding_mode, device, dtype)
        if padding_mode != "zeros":
            raise HaloError(f"{self.layer_name}: padding_mode={padding_mode!r} is not "
                            f"supported across ranks; use 'zeros'")
        self.init_spatial(grid)

    def _pads(self, a):
        if self.padding == "same":
            return same_padding(self.kernel_size[a], self.dilation[a])
        if self.padding == "valid":
            return 0, 0
        return self.padding[a], self.padding[a]

    def axis_halos(self, axis, n):
        lo, hi = self._pads(axis)
        parts = self.grid.spatial_shape[axis]
        return [conv_axis_halo(n, parts, i, self.kernel_size[axis], self.stride[axis], lo, hi,
                               self.dilation[axis]) for i in range(parts)]

    def make_extra(self, global_shape, halos):
        return ConvOp(self.stride, self.dilation, self.groups, self.out_channels,
                      tuple(h.out[1] - h.out[0] for h in halos))

    def forward(self, x):
        entry = self.spatial_plan(x)
        return halo_stencil(x, entry.halo, entry.extra, self.weight, self.bias)


class ConvTransposeOp(StencilOp):
    """Transposed convolution of the needed inputs, then crop / zero-extend to the owned
    outputs (``crops[a] = (lo, hi)`` in ``F.pad`` convention: negative crops), then bias."""

    def __init__(self, stride, dilation, groups, out_channels, out_shape, crops):
        self.stride, self.dilation, self.groups = stride, dilation, groups
        self.out_channels, self.out_shape = out_channels, out_shape
        self.pad = [p for a in (2, 1, 0) for p in crops[a]]
        self.trivial = not any(self.pad)

    def forward(self, ext, weight, bias=None):
        if 0 in ext.shape[2:]:
            out = _empty_out(ext, self.out_channels, self.out_shape)
        else:
            out = F.conv_transpose3d(ext, weight, bias if self.trivial else None, self.stride,
                                     0, 0, self.groups, self.dilation)
            if self.trivial:
                return out
            out = F.pad(out, self.pad)
        if bias is not None:
            out = out + bias.view(1, -1, 1, 1, 1)
        return out

    def backward(self, ext, grad_out, params, needs):
        weight, bias = params
        gb = grad_out.sum((0, 2, 3, 4)) if bias is not None and needs[2] else None
        if 0 in ext.shape[2:]:
            return (torch.zeros_like(ext) if needs[0] else None,
                    torch.zeros_like(weight) if needs[1] else None, gb)
        g = grad_out if self.trivial else F.pad(grad_out, [-p for p in self.pad]).contiguous()
        gi, gw, _ = torch.ops.aten.convolution_backward(
            g, ext, weight, None, self.stride, [0, 0, 0], self.dilation, True, [0, 0, 0],
            self.groups, [needs[0], needs[1], False])
        return gi, gw, gb


class SpatialConvTranspose3d(SpatialModule, nn.ConvTranspose3d):
    """``torch.nn.ConvTranspose3d`` over a spatially split volume (any k, s, p, output_padding,
    dilation, groups). Output o receives input i when o = s*i - p + d*t: each rank reads the
    inputs feeding its owned outputs (DESIGN §2) and crops the local result to them."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 output_padding=0, groups=1, bias=True, dilation=1, padding_mode="zeros",
                 device=None, dtype=None, *, grid):
        nn.ConvTranspose3d.__init__(self, in_channels, out_channels, kernel_size, stride,
                                    padding, output_padding, groups, bias, dilation,
                                    padding_mode, device, dtype)
        self.init_spatial(grid)

    def axis_halos(self, axis, n):
        parts = self.grid.spatial_shape[axis]
        return [transposed_axis_halo(n, parts, i, self.kernel_size[axis], self.stride[axis],
                                     self.padding[axis], self.output_padding[axis],
                                     self.dilation[axis]) for i in range(parts)]

    def make_extra(self, global_shape, halos):
        crops, shape = [], []
        for a, h in enumerate(halos):
            s, d, k = self.stride[a], self.dilation[a], self.kernel_size[a]
            length = h.out[1] - h.out[0]
            shape.append(length)
            first = h.needed[0] - h.pad_lo  # global index of ext[0] (may be padding)
            width = h.pad_lo + h.needed[1] - h.needed[0] + h.pad_hi
            full = (width - 1) * s + d * (k - 1) + 1 if width else 0
            start = h.out[0] + self.padding[a] - s * first  # owned output 0 in local result
            crops.append((-start, start + length - full) if width else (0, 0))
        return ConvTransposeOp(self.stride, self.dilation, self.groups, self.out_channels,
                               tuple(shape), crops)

    def forward(self, x, output_size=None):
        if output_size is not None:
            raise HaloError(f"{self.layer_name}: output_size= is not supported; set "
                            f"output_padding in the constructor")
        entry = self.spatial_plan(x)
        return halo_stencil(x, entry.halo, entry.extra, self.weight, self.bias)


__all__ = ["SpatialConv3d", "SpatialConvTranspose3d", "ConvOp", "ConvTransposeOp"]
