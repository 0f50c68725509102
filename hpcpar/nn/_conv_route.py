"""Which CPU kernel torch picks for a 3D convolution, and where hpcpar routes it to oneDNN
instead: shared by the spatial convolution (:mod:`.conv`) and its boundary fast path
(:mod:`._boundary_conv`), which must agree on the route for every rank's piece.
"""

from __future__ import annotations

import functools
import os

import torch

from hpcpar.parallel.halo_buffers import input_layout, memory_format

__all__ = ["torch_picks_slow_conv", "onednn", "onednn_shape", "onednn_backward",
           "pointwise", "pointwise_forward", "pointwise_backward", "prepadded_weight_grad",
           "onednn_avx512", "SPLIT_BACKWARD_BYTES", "CHUNK_BACKWARD_BYTES"]

#: Inputs up to this size get their three conv gradients from one call (a call's fixed cost
#: is then worth more than the volume a split backward saves: ``ConvOp.backward``,
#: :func:`prepadded_weight_grad`); larger ones take them in two.
SPLIT_BACKWARD_BYTES = 4 << 20

#: A CPU convolution's backward whose output gradient is larger than this runs in chunks of
#: about this size along the longest axis (``ConvOp._chunked``): its copies of the output
#: gradient are then a chunk's, not the whole volume's.
CHUNK_BACKWARD_BYTES = 8 << 20


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
    return (ext.device.type == "cpu" and ext.dtype == torch.float32 and
            torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled) and
            onednn_shape(ext.shape, kernel, stride, dilation, groups))


def onednn_backward(grad, x, weight, padding, stride, dilation, groups, mask):
    """The gradients ``(input, weight, bias)`` (None where ``mask`` says not wanted) of
    ``mkldnn_convolution(x, weight, bias, padding, stride, dilation, groups)`` on the route of
    :func:`onednn`. torch's backward takes oneDNN only when handed oneDNN tensors, each a copy of a
    dense one; so only the weight and bias gradients go that way (they read ``x``). With stride 1
    the input gradient is a forward convolution of ``grad`` with the kernel flipped and its channel
    axes swapped (padding ``dilation * (k - 1) - padding``), which oneDNN runs on the dense tensors
    as they are, in their memory format: no copy in, none out (against the one call, which copies
    its input gradient out twice: 16 -> 16 channels at 34^3 channels-last 13.7 -> 12.0 ms a layer;
    the backward's peak at 4 -> 16, 64^3, 31.5 -> 17.9 MiB; AVX-512 host). Equal to torch's up to
    float32 rounding: the same sums in another order. Strided convolutions keep the one call."""
    pads = [d * (k - 1) - p for d, k, p in zip(dilation, weight.shape[2:], padding)]
    flipped = all(s == 1 for s in stride) and min(pads) >= 0
    gi = gw = gb = None
    if mask[1] or mask[2] or (mask[0] and not flipped):
        want = [mask[0] and not flipped, mask[1], mask[2]]
        gi, gw, gb = torch.ops.aten.convolution_backward(
            grad.to_mkldnn(), x.to_mkldnn(), weight, [weight.shape[0]], list(stride),
            list(padding), list(dilation), False, [0, 0, 0], groups, want)
        if gi is not None:
            gi = gi.to_dense()
    if mask[0] and flipped:
        out_c, in_g = weight.shape[0], weight.shape[1]
        adjoint = (weight.reshape(groups, out_c // groups, in_g, *weight.shape[2:])
                   .transpose(1, 2).reshape(in_g * groups, out_c // groups, *weight.shape[2:])
                   .flip(2, 3, 4).contiguous())
        gi = torch.mkldnn_convolution(grad, adjoint, None, pads, [1, 1, 1], list(dilation),
                                      groups)
    if gi is not None:   # in the input's memory format (a no-op where it already is)
        gi = gi.contiguous(memory_format=memory_format(input_layout(x)))
    return gi, gw, gb


def onednn_shape(shape, kernel, stride, dilation, groups) -> bool:
    """:func:`onednn`'s rule from a float32 CPU piece's ``shape`` alone (the planner's question)."""
    if all(k == 1 for k in kernel) and all(s == 1 for s in stride):
        return False
    return torch_picks_slow_conv(shape, kernel, stride, dilation, groups)


def pointwise(x, weight, stride, groups) -> bool:
    """Whether this convolution is taken as a matrix product over channels: a CPU 1x1x1
    kernel of stride 1 without groups, on a dense input of either memory format, with the
    weight's dtype. torch's CPU kernel for it copies a channels-last input and output gradient to
    NCDHW, returns NCDHW, and its backward holds 2.5-3x the input gradient (4 -> 2 channels at 116^3
    channels-last: backward 32-44 against 15-16 ms as products, 10 against 4 channel-volumes
    allocated; one thread, AVX-512 host). The final layer of a U-Net (UNet3D's at 116^3 was its
    peak) and every bottleneck of a ResNet are such layers."""
    return (x.device.type == "cpu" and x.dim() == 5 and groups == 1 and x.is_floating_point()
            and x.dtype == weight.dtype and all(k == 1 for k in weight.shape[2:])
            and all(s == 1 for s in stride) and _matrices(x) is not None)


def _matrices(t):
    """``t`` (N, C, D, H, W) as N matrices (C, D*H*W), a view in either memory format (None
    for other strides): the operands of :func:`pointwise`'s products, never copied."""
    n, c = t.shape[:2]
    if t.is_contiguous():
        return t.view(n, c, -1)
    if t.is_contiguous(memory_format=torch.channels_last_3d):
        return t.movedim(1, -1).reshape(n, -1, c).transpose(1, 2)
    return None


def _as_volume(m, like):
    """Products ``m`` as a volume like ``like``: (N, C, V) if NCDHW, (N, V, C) if channels-last."""
    n, _, *vol = like.shape
    if like.is_contiguous():
        return m.view(n, -1, *vol)
    return m.view(n, *vol, -1).permute(0, 4, 1, 2, 3)


def pointwise_forward(x, weight, bias):
    """``conv3d(x, weight, bias)`` of a :func:`pointwise` layer, in ``x``'s memory format.
    The volume is a tensor of its own, not a view of the product: a custom Function's output
    that is a view may not be written in place (``y = conv1x1(h); y += h``)."""
    w = weight.reshape(weight.shape[0], -1)
    if x.is_contiguous():
        out = torch.matmul(w, _matrices(x))
        if bias is not None:
            out += bias.view(1, -1, 1)
        return _unviewed(_as_volume(out, x))
    rows = x.movedim(1, -1).reshape(-1, x.shape[1])   # a voxel a row, all samples at once
    out = torch.addmm(bias, rows, w.t()) if bias is not None else torch.mm(rows, w.t())
    return _unviewed(_as_volume(out.view(x.shape[0], -1, w.shape[0]), x))


def _unviewed(v: torch.Tensor) -> torch.Tensor:
    """The view ``v`` of a fresh tensor as a tensor of its own over the same memory (no
    copy, no base): called where no gradient is recorded (a custom Function's forward)."""
    return v.new_empty(0).set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())


def pointwise_backward(grad, x, weight, mask):
    """The gradients ``(input, weight, bias)`` (None where ``mask`` says not wanted) of
    :func:`pointwise_forward`, the input's in its memory format; an output gradient in
    neither format is first made dense in the input's."""
    g = _matrices(grad)
    if g is None:
        g = _matrices(grad.contiguous(memory_format=memory_format(input_layout(x))))
    w = weight.reshape(weight.shape[0], -1)
    gx = gw = gb = None
    if mask[0]:
        gx = _as_volume(torch.matmul(w.t(), g) if x.is_contiguous() else
                        torch.matmul(g.transpose(1, 2), w), x)
    if mask[1]:
        gw = torch.bmm(g, _matrices(x).transpose(1, 2)).sum(0).view(weight.shape)
    if mask[2]:
        gb = g.sum((0, 2))
    return gx, gw, gb


def prepadded_weight_grad(x, weight, groups) -> bool:
    """Whether a padded convolution's weight gradient is taken from a zero-padded copy of its input
    (padding 0) instead of handing the padding to oneDNN: faster and leaner for channels-last inputs
    with few channels where oneDNN has no AVX-512 kernels (CPU float32, 3^3 kernel, AVX2 host: 16 ->
    16 channels at 128^3, backward 1527 -> 1134 ms, peak above its inputs 283 -> 262 MiB). Not taken
    where it measured slower or fatter: channels-last from 16 -> 32 or 32 -> 16 channels up
    (0.64-0.83x, hence the bound on in x out channels); every layer on an AVX-512 host, where
    oneDNN's padded call wins (the weight gradient at 16 -> 16, 128^3: 271-380 against 360-462 ms,
    peak 139 against 274 MiB); contiguous inputs (faster on AVX2, but twice the peak). Depends only
    on the layer, the memory format and the host's instruction set, never on a timing, so a run
    repeats bitwise. Inputs up to SPLIT_BACKWARD_BYTES take the one call."""
    if (x.numel() * x.element_size() <= SPLIT_BACKWARD_BYTES or x.device.type != "cpu"
            or x.dtype != torch.float32 or groups != 1 or x.dim() != 5 or x.is_contiguous()
            or not x.is_contiguous(memory_format=torch.channels_last_3d)
            or not torch.backends.mkldnn.is_available() or onednn_avx512()):
        return False
    return weight.shape[0] * weight.shape[1] <= 256


#: oneDNN's instruction sets below AVX-512 (its ``ONEDNN_MAX_CPU_ISA`` names)
_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")


@functools.cache
def onednn_avx512() -> bool:
    """Whether oneDNN runs its AVX-512 kernels here: the CPU has them (torch's own check)
    and ``ONEDNN_MAX_CPU_ISA`` (or its old name ``DNNL_MAX_CPU_ISA``) does not cap it below."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "")
    if cap.strip().upper() in _BELOW_AVX512:
        return False
    check = getattr(torch.cpu, "_is_avx512_supported", None)
    return bool(check()) if callable(check) else \
        torch.backends.cpu.get_cpu_capability() == "AVX512"
