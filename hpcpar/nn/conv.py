"""Spatially partitioned 3D convolutions: torch's Conv3d / ConvTranspose3d plus ``grid=``.

Each rank convolves its own sub-volume extended by the halo (``padding=0`` on the explicitly
padded input: torch's CPU conv is faster that way, and only boundary ranks pad). Halo widths come
from output ownership (DESIGN §2), so any kernel/stride/padding/dilation is exact. Weight and
bias gradients are this rank's partial ones; the gradient sync sums them over the spatial group.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hpcpar.errors import LayerError
from hpcpar.parallel.comm import allreduce_
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo import StencilOp, halo_stencil
from hpcpar.parallel.halo_buffers import input_layout, memory_format
from hpcpar.parallel.halo_plan import global_spatial_shape, neighbour_only
from hpcpar.parallel.partition import (
    MapWindow,
    ceil_div,
    conv_axis_halo,
    conv_pads,
    live_taps,
    map_window,
    part_ranges,
    stencil_input_range,
    torch_pad,
    transposed_axis_halo,
    xyz,
)
from hpcpar.parallel.spatial import allgather_volume

from . import _boundary_conv
from ._base import SpatialModule
from ._boundary_conv import boundary_conv, boundary_spec
from ._conv_route import CHUNK_BACKWARD_BYTES, SPLIT_BACKWARD_BYTES  # noqa: F401 - read here
from ._conv_route import onednn as _onednn
from ._conv_route import onednn_backward as _onednn_backward
from ._conv_route import pointwise as _pointwise
from ._conv_route import pointwise_backward as _pointwise_backward
from ._conv_route import pointwise_forward as _pointwise_forward
from ._conv_route import torch_picks_slow_conv as _torch_picks_slow_conv
from ._tap_trim import tap_trim

__all__ = ["SpatialConv3d", "SpatialConvTranspose3d", "ConvOp", "ConvTransposeOp"]

#: The largest input (all samples and channels) a convolution whose halos reach past the
#: adjacent rank gathers whole on every rank (:meth:`SpatialConv3d.whole_route`)
WHOLE_MAP_BYTES = 256 << 20

#: torch's ``padding_mode`` values (only ``"zeros"`` is accepted on a split volume)
PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]


def _perm(t, perm, base=2):
    return tuple(t[:base]) + tuple(t[base + p] for p in perm)


class ConvOp(StencilOp):
    """Valid convolution of the halo-extended tensor. Where torch would pick its slow CPU kernel,
    the spatial dims are permuted to put the shortest extent last (the halo buffer is laid out
    that way: no copy); where that does not escape the rule (a cube), oneDNN is called directly."""

    autocast = True

    def __init__(self, stride, dilation, groups, out_channels, out_shape, kernel):
        self.stride, self.dilation, self.groups = stride, dilation, groups
        self.out_channels, self.out_shape, self.kernel = out_channels, out_shape, kernel
        self.boundary = None  # set by SpatialConv3d where its fast path applies

    def layout(self, ext_shape, dtype, device):
        if (device.type != "cpu" or dtype != torch.float32 or 0 in ext_shape or
                not torch.backends.mkldnn.is_available() or
                not _torch_picks_slow_conv(ext_shape, self.kernel, self.stride, self.dilation,
                                           self.groups)):
            return None
        order = tuple(sorted(range(3), key=lambda a: -ext_shape[2 + a]))
        if order == (0, 1, 2) or _torch_picks_slow_conv(
                _perm(ext_shape, order), _perm(self.kernel, order, 0),
                _perm(self.stride, order, 0), _perm(self.dilation, order, 0), self.groups):
            return None
        return order

    @staticmethod
    def _memory_order(ext) -> tuple[int, ...]:  # spatial dims, outermost in memory first
        strides = ext.stride()[2:]
        return tuple(sorted(range(3), key=lambda a: -strides[a]))

    def _permuted(self, ext, weight):
        """(ext, weight, stride, dilation, inverse perm) with spatial dims in memory order."""
        order = self._memory_order(ext)
        if order == (0, 1, 2):
            return ext, weight, self.stride, self.dilation, None
        inv = [order.index(a) for a in range(3)]
        return (ext.permute(0, 1, *(2 + a for a in order)),
                weight.permute(0, 1, *(2 + a for a in order)).contiguous(),
                _perm(self.stride, order, 0), _perm(self.dilation, order, 0),
                (0, 1, *(2 + a for a in inv)))

    def forward(self, ext, weight, bias=None):
        if 0 in self.out_shape:
            return ext.new_zeros((ext.shape[0], self.out_channels, *self.out_shape))
        if _pointwise(ext, weight, self.stride, self.groups):
            return _pointwise_forward(ext, weight, bias)
        ext, weight, stride, dilation, inv = self._permuted(ext, weight)
        if _onednn(ext, weight.shape[2:], stride, dilation, self.groups):
            out = torch.mkldnn_convolution(ext, weight, bias, [0, 0, 0], stride, dilation,
                                           self.groups)
        else:
            out = F.conv3d(ext, weight, bias, stride, 0, dilation, self.groups)
        return out if inv is None else out.permute(*inv).contiguous()

    def backward(self, holder, grad_out, params, needs):
        axis, spans = self._chunk_spans(grad_out, holder[0])
        if spans is None:
            return self._backward(holder, grad_out, *params, needs)
        return self._chunked(holder, grad_out, *params, needs, axis, spans)

    def _copies_whole(self, ext) -> bool:
        """Whether one pass copies the whole output gradient (permuted, or oneDNN's
        ``to_mkldnn``): only then do chunks save memory. Elsewhere they only add copies (16 -> 16
        channels, 64 x 128^2 channels-last per rank at 2x1x1: 2.6 s of backward in 8 chunks a
        layer against 1.5 s in one pass, measured)."""
        return self._memory_order(ext) != (0, 1, 2) or _onednn(
            ext, self.kernel, self.stride, self.dilation, self.groups)

    def _chunk_spans(self, grad_out, ext):
        """(axis, [(out_lo, out_hi, in_lo, in_hi), ...]), or (None, None): one pass."""
        nbytes = grad_out.numel() * grad_out.element_size()
        if (grad_out.device.type != "cpu" or nbytes <= CHUNK_BACKWARD_BYTES or
                0 in self.out_shape or grad_out.dim() != 5 or not self._copies_whole(ext)):
            return None, None
        a = max(range(3), key=lambda i: grad_out.shape[2 + i])
        n = grad_out.shape[2 + a]
        parts = min(n, ceil_div(nbytes, CHUNK_BACKWARD_BYTES))
        if parts < 2:
            return None, None
        k, st, dl = self.kernel[a], self.stride[a], self.dilation[a]
        return 2 + a, [(lo, hi, *stencil_input_range(lo, hi, k, st, 0, dl))
                       for lo, hi in part_ranges(n, parts)]

    def _chunked(self, holder, grad_out, weight, bias, needs, axis, spans):
        """The backward in chunks of the output gradient. One pass copies the whole output
        gradient two or three times: 98-133 MiB above the saved tensors on CosmoFlow's first
        layer (16 x 64 x 64 x 128 per rank at 2x2x1); a chunk's copies are a chunk's size."""
        ext = holder.pop()
        gw = gb = None
        if needs[1] or (bias is not None and needs[2]):
            for lo, hi, i0, i1 in spans:
                _, w_, b_ = self._backward([ext.narrow(axis, i0, i1 - i0)],
                                           grad_out.narrow(axis, lo, hi - lo), weight, bias,
                                           (False, needs[1], needs[2]))
                gw = w_ if gw is None else gw.add_(w_)
                gb = b_ if gb is None else gb.add_(b_)
        if not needs[0]:
            return None, gw, gb
        like = torch.empty_like(ext, device="meta")   # shape and memory order, no data
        del ext
        gi = torch.zeros_like(like, device=grad_out.device)
        for lo, hi, i0, i1 in spans:
            # the input's values are not read for its gradient: an empty dense chunk
            piece = torch.empty_like(like.narrow(axis, i0, i1 - i0), device=grad_out.device)
            g = self._backward([piece], grad_out.narrow(axis, lo, hi - lo), weight, bias,
                               (True, False, False))[0]
            gi.narrow(axis, i0, i1 - i0).add_(g)
        return gi, gw, gb

    def _backward(self, holder, grad_out, weight, bias, needs):
        """One pass. Weight/bias gradients first (they read the extended input), then free it
        for the input gradient (which reads only its shape): one volume less at peak. A small
        input (or the oneDNN route) takes one call for all three, as torch does (~0.1 ms)."""
        ext = holder.pop()
        if 0 in self.out_shape:
            return (torch.zeros_like(ext) if needs[0] else None,
                    torch.zeros_like(weight) if needs[1] else None,
                    torch.zeros_like(bias) if bias is not None and needs[2] else None)
        mask = [needs[0], needs[1], bias is not None and needs[2]]
        if _pointwise(ext, weight, self.stride, self.groups):
            return _pointwise_backward(grad_out, ext, weight, mask)
        ext, w, stride, dilation, inv = self._permuted(ext, weight)
        if inv is not None:
            order = [inv.index(2 + a) - 2 for a in range(3)]  # spatial dims in memory order
            grad_out = grad_out.permute(0, 1, *(2 + a for a in order)).contiguous()
        args = (None if bias is None else [bias.shape[0]], stride, [0, 0, 0], dilation, False,
                [0, 0, 0], self.groups)
        aten_bwd = torch.ops.aten.convolution_backward
        if _onednn(ext, w.shape[2:], stride, dilation, self.groups):
            gi, gw, gb = _onednn_backward(grad_out, ext, w, [0, 0, 0], stride, dilation,
                                         self.groups, mask)
        elif ext.numel() * ext.element_size() <= SPLIT_BACKWARD_BYTES:
            gi, gw, gb = aten_bwd(grad_out, ext, w, *args, mask)
        else:
            gw = gb = gi = None
            if any(mask[1:]):
                _, gw, gb = aten_bwd(grad_out, ext, w, *args, [False, *mask[1:]])
            if needs[0]:
                # values of the input are not read for grad_input: an untouched empty tensor
                # (no pages faulted in) stands in for it once the real one is released
                shape, strides = ext.shape, ext.stride()
                del ext
                gi = aten_bwd(grad_out, torch.empty_strided(shape, strides, dtype=w.dtype,
                                                            device=w.device),
                              w, *args, [True, False, False])[0]
        if inv is not None:
            gi = gi.permute(*inv) if gi is not None else None
            gw = gw.permute(*inv).contiguous() if gw is not None else None
        return gi, gw, gb


class _WholeConv(torch.autograd.Function):
    """This rank's output piece from the gathered map, holding only the piece until backward,
    which gathers the map again (one map at a time, not one per layer) and sums its gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv, windows):
        ctx.conv, ctx.windows = conv, windows
        ctx.save_for_backward(x, weight, bias)
        full, _ = allgather_volume(x.detach(), conv.grid)
        return conv.window_conv(full, weight, bias, windows)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        conv, windows = ctx.conv, ctx.windows
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        box = tuple(slice(*w.box) for w in windows)
        full, own = allgather_volume(x.detach(), conv.grid)
        gshape = full.shape[2:]
        part = full[(..., *box)].detach().requires_grad_(need_x)
        del full    # the window (a view of it) is all that is read again
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        leaves = [t for t, need in ((part, need_x), (w, need_w), (b, need_b))
                  if need and t is not None]
        with torch.enable_grad():
            y = conv.window_conv(part, w, b, windows, whole=False)
        got = list(torch.autograd.grad(y, leaves, grad)) if leaves else []
        del y, leaves, part, w, b
        gp = got.pop(0) if need_x else None
        gw = got.pop(0) if need_w else None
        gb = got.pop(0) if need_b and bias is not None else None
        gx = None
        if gp is not None:
            gx = x.new_zeros((*x.shape[:2], *gshape))
            gx[(..., *box)] = gp
            del gp
            gx = allreduce_(gx, conv.grid.spatial_comm)[own].contiguous()
        return gx, gw, gb, None, None


class SpatialConv3d(SpatialModule, nn.Conv3d):
    """``torch.nn.Conv3d`` over a volume split on the grid's x, y, z axes (dims 2, 3, 4).

    Takes ``nn.Conv3d``'s arguments (``padding`` ints, ``"same"`` or ``"valid"``) plus ``grid``;
    same parameters and state_dict keys (each loads the other's). The forward exchanges halos
    whose widths follow from output ownership, then convolves with ``padding=0``; the result
    equals ``nn.Conv3d`` on the whole volume, split with the partition rule of the output's
    global length. Raises LayerError for a ``padding_mode`` other than ``"zeros"``; at forward,
    for a local extent smaller than the halo a neighbour needs, or inputs that differ across the
    spatial group (the same error on every rank)."""

    def __init__(self, in_channels: int, out_channels: int,
                 kernel_size: int | tuple[int, int, int], stride: int | tuple[int, int, int] = 1,
                 padding: str | int | tuple[int, int, int] = 0,
                 dilation: int | tuple[int, int, int] = 1, groups: int = 1, bias: bool = True,
                 padding_mode: PaddingMode = "zeros", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, *, grid: ProcessGrid):
        nn.Conv3d.__init__(self, in_channels, out_channels, kernel_size, stride, padding,
                           dilation, groups, bias, padding_mode, device, dtype)
        if padding_mode != "zeros":
            raise LayerError(f"{self.layer_name}: padding_mode={padding_mode!r} is not "
                             f"supported across ranks; use 'zeros'")
        self.init_spatial(grid)

    def axis_halos(self, axis, n):
        lo, hi = conv_pads(self.padding, axis, self.kernel_size[axis], self.dilation[axis])
        parts = self.grid.spatial_shape[axis]
        return [conv_axis_halo(n, parts, i, self.kernel_size[axis], self.stride[axis], lo, hi,
                               self.dilation[axis]) for i in range(parts)]

    def make_extra(self, global_shape, halos):
        op = ConvOp(self.stride, self.dilation, self.groups, self.out_channels,
                    tuple(h.out[1] - h.out[0] for h in halos), self.kernel_size)
        op.boundary = boundary_spec(self, global_shape, self.grid)
        return op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spatial_forward(x, self.weight, self.bias)

    def spatial_forward(self, x, weight, bias, gshape=None) -> torch.Tensor:
        """With given parameters (``F.conv3d`` on a split tensor comes here)."""
        if gshape is None:
            gshape = global_spatial_shape(x, self.grid, what=self.layer_name)
        trimmed = self.trimmed(gshape)
        if trimmed is not None:
            twin, taps = trimmed
            return twin.spatial_forward(x, weight[taps], bias, gshape)
        whole = self.whole_route(x, gshape)
        if whole is not None:
            y = _WholeConv.apply(x, weight, bias, self, whole)
            return y.contiguous(memory_format=memory_format(input_layout(x)))
        entry = self.spatial_plan(x, gshape)
        if self.boundary_path(x, entry):
            return boundary_conv(x, weight, bias, entry.extra.boundary)
        return halo_stencil(x, entry.halo, entry.extra, weight, bias)

    def whole_route(self, x, gshape) -> tuple[MapWindow, MapWindow, MapWindow] | None:
        """Where a halo reaches past the adjacent rank's piece (a dilated kernel on a small map:
        ASPP's rates on a deep layer), the one exact route is the whole map: each rank gathers it
        and convolves its own output piece. Where a halo is as long as its piece and the exchange
        would hold a buffer more than twice the map, the map is cheaper too (its backward holds
        two). Taken when the map is at most :data:`WHOLE_MAP_BYTES` and every rank's outputs read
        some of it. This rank's window on each axis, or None; the same choice on every rank."""
        key = (tuple(gshape), x.shape[0] * x.shape[1] * x.element_size())
        cache = self.__dict__.setdefault("_whole_routes", {})
        if key not in cache:
            halos = [self.axis_halos(a, gshape[a]) for a in range(3)]
            far = not all(neighbour_only(h) for h in halos)
            wide = any(max(h.halo_lo, h.halo_hi) >= h.owned[1] - h.owned[0]
                       for line in halos for h in line)
            buffer = math.prod(max(h.needed[1] - h.needed[0] + h.pad_lo + h.pad_hi
                                   for h in line) for line in halos)
            voxels = math.prod(gshape)
            small = key[1] * voxels <= WHOLE_MAP_BYTES
            # every rank's outputs read the map on every axis (not padding alone: the
            # exchange serves outputs that are the bias only)
            stencils = [(gshape[a], self.kernel_size[a], self.stride[a], self.dilation[a],
                         *conv_pads(self.padding, a, self.kernel_size[a], self.dilation[a]))
                        for a in range(3)]
            reads = all(h.out[1] > h.out[0] and live_taps(*st, h.out) is not None
                        for line, st in zip(halos, stencils) for h in line)
            mine = [h[c].out for h, c in zip(halos, self.grid.spatial_coords)]
            cache[key] = tuple(map_window(out, *st) for out, st in zip(mine, stencils)) \
                if (far or wide and buffer > 2 * voxels) and small and reads else None
        return cache[key]

    def window_conv(self, full, weight, bias, windows, whole=True):
        """This rank's output piece from the whole map ``full`` (``whole=False``: the window):
        the taps that read the map, the window they read, and padding past the map's edge (given
        to the convolution where even, so never made: under a large dilation it is many maps)."""
        taps = tuple(slice(*w.taps) for w in windows)
        part = full[(..., *(slice(*w.box) for w in windows))] if whole else full
        # padding p = max(lo, hi) on both sides computes (p - lo) / stride outputs too many
        # below and some above, cropped; where the stride does not divide, the pad is made
        same, made, crop = [], [], []
        for w, s in zip(windows, self.stride):
            (lo, hi), p = w.pads, max(w.pads)
            even = (p - lo) % s == 0
            same.append(p if even else 0)
            made.append((0, 0) if even else (lo, hi))
            first = (p - lo) // s if even else 0
            crop.append(slice(first, first + w.count))
        if any(lo or hi for lo, hi in made):
            part = F.pad(part, [p for lo_hi in reversed(made) for p in lo_hi])
        y = F.conv3d(part, weight[(..., *taps)], bias, self.stride, tuple(same),
                     self.dilation, self.groups)
        return y[(..., *crop)]

    def trimmed(self, gshape) -> tuple[SpatialConv3d, tuple[slice, ...]] | None:
        """``(twin, taps)``: the convolution without the taps that only read padding on
        ``gshape``, and its weight's index in this one's; None where every tap reads data."""
        cache = self.__dict__.setdefault("_trimmed", {})
        key = tuple(gshape)
        if key not in cache:
            trim = tap_trim(key, self.kernel_size, self.stride, self.dilation, self.padding)
            cache[key] = None if trim is None else (SpatialConv3d(
                self.in_channels, self.out_channels, trim.kernel, xyz(self.stride), trim.padding,
                trim.dilation, self.groups, self.bias is not None, device="meta",
                grid=self.grid), trim.taps)
        return cache[key]

    def boundary_path(self, x, entry) -> bool:
        """Ghosts travel while the interior computes; not where torch's slow CPU kernel runs."""
        spec = entry.extra.boundary
        return spec is not None and _boundary_conv.ENABLED and \
            not torch.is_autocast_enabled(x.device.type) and \
            (x.device.type != "cpu" or spec.fast(x.shape[0]))


class ConvTransposeOp(StencilOp):
    """Transposed convolution of the needed inputs, crop / zero-extend to the owned outputs
    (``crops[a] = (lo, hi)`` in ``F.pad`` convention: negative crops), then bias."""

    autocast = True

    def __init__(self, stride, dilation, groups, out_channels, out_shape, crops):
        self.stride, self.dilation, self.groups = stride, dilation, groups
        self.out_channels, self.out_shape = out_channels, out_shape
        self.pad = torch_pad(crops)
        self.trivial = not any(self.pad)

    def forward(self, ext, weight, bias=None):
        if 0 in ext.shape[2:]:
            out = ext.new_zeros((ext.shape[0], self.out_channels, *self.out_shape))
        else:
            out = F.conv_transpose3d(ext, weight, bias if self.trivial else None, self.stride,
                                     0, 0, self.groups, self.dilation)
            if self.trivial:
                return out
            out = F.pad(out, self.pad)
        if bias is not None:
            out = out + bias.view(1, -1, 1, 1, 1)
        return out

    def backward(self, holder, grad_out, params, needs):
        weight, bias = params
        ext = holder.pop()
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
    """``torch.nn.ConvTranspose3d``'s arguments plus ``grid``, over a spatially split volume.
    Output o receives input i when o = s*i - p + d*t: each rank reads the inputs feeding its
    owned outputs and crops the local result to them. Raises LayerError at forward for
    ``output_size=`` (set ``output_padding`` instead), inputs too small for the halos, or inputs
    inconsistent across the spatial group."""

    def __init__(self, in_channels: int, out_channels: int,
                 kernel_size: int | tuple[int, int, int], stride: int | tuple[int, int, int] = 1,
                 padding: int | tuple[int, int, int] = 0,
                 output_padding: int | tuple[int, int, int] = 0, groups: int = 1,
                 bias: bool = True, dilation: int | tuple[int, int, int] = 1,
                 padding_mode: PaddingMode = "zeros", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, *, grid: ProcessGrid):
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

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if output_size is not None:
            raise LayerError(f"{self.layer_name}: output_size= is not supported; set "
                             f"output_padding in the constructor")
        return self.spatial_forward(x, self.weight, self.bias)

    def spatial_forward(self, x, weight, bias, gshape=None) -> torch.Tensor:
        """With given parameters (``F.conv_transpose3d`` on a split tensor comes here)."""
        entry = self.spatial_plan(x, gshape)
        return halo_stencil(x, entry.halo, entry.extra, weight, bias)
