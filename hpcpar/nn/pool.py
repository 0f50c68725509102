"""Spatially partitioned 3D max / average pooling (torch's MaxPool3d / AvgPool3d + ``grid=``).

Each rank pools its halo-extended sub-volume with padding 0. Max pooling pads the global
boundary with -inf (a padded cell never wins, like torch's implicit padding). ceil_mode's
partial last window is covered by extending the halo/padding to the window's end.
Average pooling sums windows and divides by torch's per-window divisor, which is separable:
``count_include_pad`` counts cells inside [-p, N+p) (ceil_mode's overhang never counts),
otherwise cells inside [0, N); ``divisor_override`` replaces it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo import StencilOp, halo_stencil
from hpcpar.parallel.partition import AxisHalo, conv_axis_halo

from ._base import SpatialModule, triple

__all__ = ["SpatialMaxPool3d", "SpatialAvgPool3d", "MaxPoolOp", "AvgPoolOp", "avg_divisors"]


class _PoolMixin(SpatialModule):
    """Halo geometry shared by the pools (kernel, stride, symmetric padding, ceil_mode)."""

    def _geometry(self):
        name = self.layer_name
        k = triple(self.kernel_size, "kernel_size", name)
        s = triple(self.stride if self.stride is not None else self.kernel_size, "stride", name)
        p = triple(self.padding, "padding", name)
        d = triple(getattr(self, "dilation", 1), "dilation", name)
        for a in range(3):
            if p[a] > k[a] // 2:  # torch's rule
                raise LayerError(f"{name}: padding {p[a]} must be at most half the kernel "
                                 f"size {k[a]}")
        return k, s, p, d

    def axis_halos(self, axis, n):
        k, s, p, d = self._geometry()
        parts = self.grid.spatial_shape[axis]
        return [conv_axis_halo(n, parts, i, k[axis], s[axis], p[axis], p[axis], d[axis],
                               self.ceil_mode) for i in range(parts)]


class MaxPoolOp(StencilOp):
    """Max-pool a rank's halo-extended piece: the stencil :class:`SpatialMaxPool3d` runs. The halo
    already holds the padding (``-inf``), so pooling uses no padding of its own; ``out_shape`` is
    this rank's output extent per spatial axis (a 0 gives an empty output)."""

    def __init__(self, kernel: tuple[int, int, int], stride: tuple[int, int, int],
                 dilation: tuple[int, int, int], out_shape: tuple[int, ...]):
        self.kernel, self.stride, self.dilation = kernel, stride, dilation
        self.out_shape = out_shape

    #: backward scatters into the argmax cells, which the indices name: no input values
    needs_input = False

    def forward(self, ext):
        if 0 in self.out_shape:
            return ext.new_zeros((*ext.shape[:2], *self.out_shape))
        return F.max_pool3d(ext, self.kernel, self.stride, 0, self.dilation)

    def forward_saving(self, ext):
        """The pooled piece and its argmax indices into ``ext`` (what torch's max pooling
        keeps too; a quarter of a 2x2x2 pool's fp32 input, instead of the input and a
        rebuilt extended copy at backward)."""
        if 0 in self.out_shape:
            return self.forward(ext), ()
        out, idx = F.max_pool3d(ext, self.kernel, self.stride, 0, self.dilation,
                                return_indices=True)
        return out, (idx,)

    def backward_saved(self, grad_ext, grad_out, saved, params, needs):
        if grad_ext is None:
            return ()
        if not saved:  # an empty output
            grad_ext.zero_()
            return ()
        args = (list(self.kernel), list(self.stride), [0, 0, 0], list(self.dilation), False,
                saved[0])
        bwd = torch.ops.aten.max_pool3d_with_indices_backward
        if grad_ext.is_contiguous() or \
                grad_ext.is_contiguous(memory_format=torch.channels_last_3d):
            # torch's kernel reads only the shape and layout of its input: grad_ext stands in
            # for it, and the kernel writes into it (a dense one: it restrides any other)
            bwd.grad_input(grad_out, grad_ext, *args, grad_input=grad_ext)
        else:  # a trimmed region of the buffer
            grad_ext.copy_(bwd(grad_out, grad_ext, *args))
        return ()


class SpatialMaxPool3d(_PoolMixin, nn.MaxPool3d):
    """``torch.nn.MaxPool3d`` over a spatially split volume (ceil_mode, dilation, padding).

    Boundary ranks pad with ``-inf``; the result equals ``nn.MaxPool3d`` on the whole volume. The
    arguments are ``nn.MaxPool3d``'s, plus the ``grid`` whose x, y, z axes split the volume.
    LayerError: ``return_indices=True`` (indices into a split volume are not supported); at forward,
    a local extent smaller than a halo."""

    def __init__(self, kernel_size: int | tuple[int, int, int],
                 stride: int | tuple[int, int, int] | None = None,
                 padding: int | tuple[int, int, int] = 0, dilation: int | tuple[int, int, int] = 1,
                 return_indices: bool = False, ceil_mode: bool = False, *, grid: ProcessGrid):
        nn.MaxPool3d.__init__(self, kernel_size, stride, padding, dilation, return_indices,
                              ceil_mode)
        if return_indices:
            raise LayerError(f"{self.layer_name}: return_indices=True is not supported (local "
                             f"indices would not address the global volume)")
        self.init_spatial(grid)
        self._geometry()

    def make_extra(self, global_shape, halos):
        k, s, _, d = self._geometry()
        return MaxPoolOp(k, s, d, tuple(h.out[1] - h.out[0] for h in halos))

    def forward(self, x: torch.Tensor, gshape=None) -> torch.Tensor:
        entry = self.spatial_plan(x, gshape)
        return halo_stencil(x, entry.halo, entry.extra, pad_value=float("-inf"))


def avg_divisors(halo: AxisHalo, kernel: int, stride: int, padding: int,
                 count_include_pad: bool) -> list[int]:
    """torch's avg-pool divisor for each owned output of ``halo`` along one axis (global rule,
    ``padding`` on each side): as ``nn.AvgPool3d`` on the whole volume, windows at the global
    boundary included."""
    out = []
    for o in range(*halo.out):
        start = o * stride - padding
        end = min(start + kernel, halo.n_in + padding)
        out.append(end - start if count_include_pad else min(end, halo.n_in) - max(start, 0))
    return out


class AvgPoolOp(StencilOp):
    """Window sums divided by a (separable) divisor tensor, or plain avg_pool when every
    owned window's divisor is the full kernel volume."""

    def __init__(self, kernel, stride, out_shape, divisor=None, override=None):
        self.kernel, self.stride, self.out_shape = kernel, stride, out_shape
        self.divisor, self.override = divisor, override

    def forward(self, ext):
        if 0 in self.out_shape:
            return ext.new_zeros((*ext.shape[:2], *self.out_shape))
        if self.divisor is None:
            return F.avg_pool3d(ext, self.kernel, self.stride, 0, False, True, self.override)
        sums = F.avg_pool3d(ext, self.kernel, self.stride, 0, False, True, 1)
        return sums / self.divisor.to(device=ext.device, dtype=ext.dtype)


class SpatialAvgPool3d(_PoolMixin, nn.AvgPool3d):
    """``torch.nn.AvgPool3d`` over a spatially split volume (ceil_mode, count_include_pad,
    divisor_override); divisors follow torch's rule in global coordinates. The arguments are
    ``nn.AvgPool3d``'s, plus the ``grid`` whose x, y, z axes split the volume. LayerError at
    forward: a local extent smaller than a halo, or inputs inconsistent across the spatial group."""

    def __init__(self, kernel_size: int | tuple[int, int, int],
                 stride: int | tuple[int, int, int] | None = None,
                 padding: int | tuple[int, int, int] = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None, *,
                 grid: ProcessGrid):
        nn.AvgPool3d.__init__(self, kernel_size, stride, padding, ceil_mode,
                              count_include_pad, divisor_override)
        self.init_spatial(grid)
        self._geometry()

    def make_extra(self, global_shape, halos):
        k, s, p, _ = self._geometry()
        shape = tuple(h.out[1] - h.out[0] for h in halos)
        if self.divisor_override:
            return AvgPoolOp(k, s, shape, override=self.divisor_override)
        divs = [avg_divisors(h, k[a], s[a], p[a], self.count_include_pad)
                for a, h in enumerate(halos)]
        if all(v == k[a] for a, d in enumerate(divs) for v in d):
            return AvgPoolOp(k, s, shape)
        t = torch.tensor(divs[0], dtype=torch.float64).view(-1, 1, 1) * \
            torch.tensor(divs[1], dtype=torch.float64).view(1, -1, 1) * \
            torch.tensor(divs[2], dtype=torch.float64).view(1, 1, -1)
        return AvgPoolOp(k, s, shape, divisor=t)

    def forward(self, x: torch.Tensor, gshape=None) -> torch.Tensor:
        entry = self.spatial_plan(x, gshape)
        return halo_stencil(x, entry.halo, entry.extra, pad_value=0.0)
