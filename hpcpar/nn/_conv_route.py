"""Which CPU kernel torch picks for a 3D convolution, and where hpcpar routes it to oneDNN
instead: shared by the spatial convolution (:mod:`.conv`) and its boundary fast path
(:mod:`._boundary_conv`), which must agree on the route for every rank's piece.
"""

from __future__ import annotations

import torch

__all__ = ["torch_picks_slow_conv", "onednn"]


def torch_picks_slow_conv(shape, kernel, stride, dilation, groups) -> bool:
    """torch's CPU rule (aten Convolution.cpp, use_mkldnn) for float32: with batch 1 and small
    kernels it falls back to the im2col 'slow_conv3d' unless N*C*D*H > 20480; the W extent
    is not counted. Sub-volumes split on x or y fall under it (measured ~7x slower)."""
    n, c, d, h, _ = shape
    general = (any(s != 1 for s in stride) or any(v != 1 for v in dilation) or n >= 16 or
               kernel[2] != 1 or kernel[1] != 1 or torch.get_num_threads() > 1)
    wide = groups > 1 or (kernel[2] > 3 and kernel[1] > 3) or n > 1 or n * c * d * h > 20480
    return not (general and wide)


def onednn(ext, kernel, stride, dilation, groups) -> bool:
    """Run this convolution on oneDNN (mkldnn) although torch would not: where torch's CPU rule
    still picks 'slow_conv3d' (batch 1, small C*D*H), oneDNN runs the same float32 convolution
    10-20x faster (24^3 x 16 channels: 15 ms -> 2.4 ms forward, 99 ms -> 7.5 ms backward,
    measured). Deep layers of a batch-1 sample, and the pieces a split makes, are that case.
    Not a 1x1x1 kernel of stride 1: torch's slow path is then one matrix product with no
    column buffer, faster than oneDNN (16 -> 2 channels at 64^3: 99 vs 254 ms forward +
    backward) and without oneDNN's copies of the input and its gradient (32 vs 56 MiB)."""
    if all(k == 1 for k in kernel) and all(s == 1 for s in stride):
        return False
    return (ext.device.type == "cpu" and ext.dtype == torch.float32 and
            torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled) and
            torch_picks_slow_conv(ext.shape, kernel, stride, dilation, groups))
