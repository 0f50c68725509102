"""Halo-aware tiling of a volume into slabs along D for :mod:`hpcpar.run.predict`, exact.

A slab's central outputs ``[a, b)`` are computed from the input ``[a - M, b + M)`` (clipped to
the volume) and only they are kept. They equal the whole-volume forward's when

- the margin ``M`` covers how far a slab's own edges (zero padding where the volume goes on,
  a pool dropping a short tail, a size match padding an up-sampled level) can reach into it:
  a stencil layer with window ``d(k-1)+1``, left padding ``p`` and stride ``s`` widens that
  reach by ``max(p, d(k-1)-p) + s-1`` of its input voxels, a transposed one by the inputs
  one output reads, each counted in the model's input voxels (times the layer's jump, the
  input voxels per voxel of its level), plus one stride. The windows come from
  the same geometry as the layers' halos (:func:`hpcpar.parallel.partition.stencil_input_range`,
  :func:`~hpcpar.parallel.partition.transposed_input_range`); summed over every layer the
  forward visits, skip connections included, the reach is over-estimated, never under;
- every slab starts at a multiple of the total stride ``S`` (the largest jump), so that each
  pooling window and each strided convolution of a slab is one of the whole volume's.

The layers are found by running the plain model once on the meta device (no data, no memory)
on a probe whose D length is divisible by any stride product up to 2^8 * 3^2 * 5, with forward
hooks on every leaf module: a leaf that changes D's length without a known geometry refuses
tiling in one line, and so does any op that reaches along D outside such a layer (a norm's
statistics, a reduction over D, a stencil called as a function: :mod:`.slab_guard`). Not
seen: a model that builds tensors from D's length itself (positional encodings from
``x.shape[2]``); the untiled forward is exact for any model.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from fractions import Fraction

from hpcpar.errors import ConfigError
from hpcpar.parallel.partition import conv_pads, stencil_input_range, transposed_input_range

__all__ = ["Slab", "param_dtype", "model_reach", "slab_plan"]

PROBE = 2 ** 8 * 3 ** 2 * 5  # D length of the meta probe: divisible by common stride products


@dataclass(frozen=True)
class Slab:
    """Central outputs ``[start, stop)`` along D, computed from inputs ``[lo, hi)``."""

    start: int
    stop: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Reach:
    """The margin (input voxels per side) and the total stride of a model along D."""

    margin: int
    stride: int


def param_dtype(model):
    """The type the model computes in: its first parameter's (float32 without any)."""
    import torch

    return next(iter(model.parameters()), torch.empty(0)).dtype


def _first(v) -> int:
    return int(v[0] if isinstance(v, tuple) else v)


def _layer_reach(module, n_in: int, n_out: int) -> tuple[int, Fraction] | None:
    """(reach in the layer's input voxels, output jump / input jump) of one leaf module along
    D; None when it keeps D's length and has no window."""
    import torch.nn as nn

    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        k, s = _first(module.kernel_size), _first(module.stride)
        d, p = _first(module.dilation), _first(module.padding)
        a, b = transposed_input_range(0, 1, k, s, p, d)
        return b - a, Fraction(1, s)
    if hasattr(module, "kernel_size") and hasattr(module, "stride"):
        k = _first(module.kernel_size)
        s = _first(module.stride if module.stride is not None else k)
        d = _first(getattr(module, "dilation", 1))
        p = conv_pads(module.padding, 0, k, d)[0]
        a, b = stencil_input_range(0, 1, k, s, p, d)   # output 0 reads inputs [a, b)
        return max(-a, b - 1) + s - 1, Fraction(s)
    if isinstance(module, nn.Upsample) or n_in != n_out:
        if n_in == 0:
            return None
        if not isinstance(module, nn.Upsample):
            raise ConfigError(f"--max-slab: layer {type(module).__name__} changes the volume's "
                              f"length ({n_in} -> {n_out}) with no known window: this model "
                              "cannot be tiled exactly; drop --max-slab")
        return 2, Fraction(n_in, n_out)
    return None


def model_reach(model, in_channels: int, hw: tuple[int, int]) -> Reach:
    """The slab margin and total stride of the plain ``model`` along D (module docstring; a
    copy runs on the meta device, with H and W ``hw``). ConfigError when a layer changes D's
    length with no known window, or an op reaches along D beyond the layers the margin counts
    (:class:`~.slab_guard.SlabGuard`)."""
    import torch

    from .slab_guard import SlabGuard  # deferred: loads the dispatch tables

    meta = copy.deepcopy(model).to("meta").eval()   # as predict runs it
    seen: list = []
    guard = SlabGuard()

    def hook(module, args, output):
        if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor) \
                and args[0].dim() == 5 and output.dim() == 5:
            seen.append((module, args[0].shape[2], output.shape[2]))

    handles = [m.register_forward_hook(hook) for m in meta.modules()
               if not list(m.children())] + guard.hooks(meta)
    try:
        with torch.no_grad(), guard:
            meta(torch.empty(1, in_channels, PROBE, *hw, device="meta",
                             dtype=param_dtype(model)))
    finally:
        for h in handles:
            h.remove()
    total = Fraction(0)
    jumps = {1}
    for module, n_in, n_out in seen:
        found = _layer_reach(module, n_in, n_out)
        if found is None:
            continue
        reach, factor = found
        jump = Fraction(PROBE, max(n_in, 1))
        total += reach * jump
        out = jump * factor
        jumps.add(math.ceil(out) if out >= 1 else 1)
    stride = math.lcm(*jumps)
    margin = -(-math.ceil(total) // stride) * stride + stride
    return Reach(margin, stride)


def slab_plan(length: int, max_slab: int | None, reach: Reach | None) -> list[Slab]:
    """The slabs covering ``[0, length)`` along D in order, each central part at most
    ``max_slab`` (rounded down to the total stride, at least one stride; None: one slab, the
    whole volume); ``reach`` is the model's :func:`model_reach`, needed when tiling."""
    if max_slab is None or max_slab >= length or reach is None:
        return [Slab(0, length, 0, length)]
    step = max(reach.stride, max_slab // reach.stride * reach.stride)
    return [Slab(a, min(a + step, length), max(0, a - reach.margin),
                 min(length, a + step + reach.margin)) for a in range(0, length, step)]
