"""``spatialize(model, grid)``: a copy of a plain torch model that runs spatially partitioned.

The copy's supported layers are replaced by their spatial twins, which take over the copy's
own Parameter and buffer objects (so state_dict keys, tags and optimiser bindings carry
over). The walk follows the modules in registration order and tracks whether the tensor is
still *partitioned* or already *replicated* (after a global pool or a gather point):

* partitioned: Conv3d, ConvTranspose3d, MaxPool3d, AvgPool3d, BatchNorm3d, Upsample,
  AdaptiveAvgPool3d(1) and modules with a ``spatial_twin(grid)`` method (``GatherPoint``,
  ``MatchSize``) are swapped; pointwise layers stay; ``Dropout2d/3d`` get rank-consistent
  channel masks; anything else (Flatten, Linear, ...) is an error naming the layer.
* replicated: layers stay as they are, their parameters are tagged data-only (their
  gradients are complete on every spatial rank) and dropout masks are made identical on
  every spatial rank.

Containers (``nn.Sequential``, ``ModuleList``, custom modules) are walked recursively; a
custom ``forward`` must call its children in registration order, or contain no state change
at all (U-Net: every op is spatial, so every layer swaps).
"""

from __future__ import annotations

import copy

import torch.nn as nn

from hpcpar.parallel.grid import ProcessGrid
from hpcpar.sync.tags import tag_data_only

from ..errors import HpcparError, LayerError
from .gather import GatherPoint, ReplicatedDropout

__all__ = ["spatialize", "POINTWISE"]

PARTITIONED, REPLICATED = "partitioned", "replicated"

POINTWISE = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.CELU, nn.SELU,
    nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish,
    nn.Softplus, nn.Softsign, nn.Softshrink, nn.Hardshrink, nn.Tanhshrink, nn.LogSigmoid,
    nn.Threshold, nn.Dropout, nn.AlphaDropout,
)


def _attrs(*names):
    return lambda m: {n: getattr(m, n) for n in names}


def _twins():
    """torch class -> (spatial class, constructor kwargs from an instance)."""
    from .conv import SpatialConv3d, SpatialConvTranspose3d
    from .norm import SpatialBatchNorm3d
    from .pool import SpatialAvgPool3d, SpatialMaxPool3d
    from .upsample import SpatialUpsample

    conv = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
            "groups", "padding_mode")
    return {
        nn.Conv3d: (SpatialConv3d, lambda m: {**_attrs(*conv)(m), "bias": m.bias is not None}),
        nn.ConvTranspose3d: (SpatialConvTranspose3d, lambda m: {
            **_attrs(*conv, "output_padding")(m), "bias": m.bias is not None}),
        nn.MaxPool3d: (SpatialMaxPool3d, _attrs("kernel_size", "stride", "padding", "dilation",
                                                "return_indices", "ceil_mode")),
        nn.AvgPool3d: (SpatialAvgPool3d, _attrs("kernel_size", "stride", "padding", "ceil_mode",
                                                "count_include_pad", "divisor_override")),
        nn.BatchNorm3d: (SpatialBatchNorm3d, _attrs("num_features", "eps", "momentum",
                                                    "affine", "track_running_stats")),
        nn.Upsample: (SpatialUpsample, _attrs("size", "scale_factor", "mode", "align_corners",
                                              "recompute_scale_factor")),
    }


def _adopt(twin: nn.Module, plain: nn.Module) -> nn.Module:
    """Make ``twin`` use ``plain``'s Parameter/buffer objects and training mode."""
    for name, p in plain._parameters.items():
        twin._parameters[name] = p
    for name, b in plain._buffers.items():
        twin._buffers[name] = b
    twin.train(plain.training)
    return twin


def _is_spatial(m: nn.Module) -> bool:
    from ._base import SpatialModule

    return isinstance(m, SpatialModule)


def _cannot(qual: str, m: nn.Module, why: str) -> LayerError:
    return LayerError(
        f"spatialize: layer '{qual or '<model>'}' ({type(m).__name__}) {why}; its input is "
        "still split over the spatial grid: put a global pool (nn.AdaptiveAvgPool3d(1)) or a "
        "gather point (hpcpar.nn.gather.GatherPoint in the plain model, or "
        "hpcpar.nn.SpatialGather) before it")


class _Walker:
    def __init__(self, grid, bn_include_data: bool):
        self.grid = grid
        self.bn_include_data = bn_include_data
        self.twins = _twins()

    def children(self, module: nn.Module, state: str, prefix: str) -> str:
        for name, child in list(module.named_children()):
            qual = f"{prefix}.{name}" if prefix else name
            new, state = self.one(child, state, qual)
            if new is not child:
                module._modules[name] = new
        return state

    def one(self, m: nn.Module, state: str, qual: str):
        if state == REPLICATED:
            return self.replicated(m), REPLICATED
        if _is_spatial(m):
            return m, REPLICATED if getattr(m, "replicates", False) else state
        if hasattr(m, "spatial_twin"):
            twin = _adopt(m.spatial_twin(self.grid), m)
            return twin, REPLICATED if getattr(twin, "replicates", False) else state
        for base, (cls, kwargs) in self.twins.items():
            if isinstance(m, base):
                if type(m).forward is not base.forward:
                    raise _cannot(qual, m, f"is a {base.__name__} with its own forward")
                extra = {"include_data": self.bn_include_data} if base is nn.BatchNorm3d else {}
                try:
                    twin = cls(**kwargs(m), grid=self.grid, **extra)
                except HpcparError as exc:
                    raise LayerError(
                        f"spatialize: layer '{qual or '<model>'}': {exc}") from exc
                return _adopt(twin, m), state
        if isinstance(m, nn.AdaptiveAvgPool3d):
            return self.global_pool(m, qual), REPLICATED
        if isinstance(m, (nn.Dropout2d, nn.Dropout3d)):
            return ReplicatedDropout(m.p, grid=self.grid, feature=True, inplace=m.inplace), state
        if isinstance(m, (nn.Softmax, nn.LogSoftmax, nn.Softmin)) and m.dim in (1, -4):
            return m, state
        if isinstance(m, POINTWISE):
            return m, state
        if len(m._modules):
            if m._parameters and any(p is not None for p in m._parameters.values()):
                raise _cannot(qual, m, "has parameters of its own next to its sub-layers")
            return m, self.children(m, state, qual)
        raise _cannot(qual, m, "needs the whole volume")

    def global_pool(self, m: nn.AdaptiveAvgPool3d, qual: str):
        from .gather import SpatialAdaptiveAvgPool3d

        size = m.output_size
        sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,) * 3
        if sizes != (1, 1, 1):
            raise _cannot(qual, m, f"has output size {size!r} (only 1, a global pool, is "
                                   "spatial)")
        return _adopt(SpatialAdaptiveAvgPool3d(1, grid=self.grid), m)

    def replicated(self, m: nn.Module) -> nn.Module:
        """Layers after the gather: same data on every spatial rank, data-only gradients."""
        if isinstance(m, GatherPoint):
            return nn.Identity()
        if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)):
            feature = not isinstance(m, nn.Dropout)
            return ReplicatedDropout(m.p, grid=self.grid, feature=feature, inplace=m.inplace)
        for p in m.parameters(recurse=False):
            tag_data_only(p)
        for name, child in list(m.named_children()):
            new = self.replicated(child)
            if new is not child:
                m._modules[name] = new
        return m


def spatialize(model: nn.Module, grid: ProcessGrid, *,
               bn_include_data: bool = False) -> nn.Module:
    """Make a copy of a plain torch model that runs on each rank's piece of the volume.

    Walks the model in registration order: ``Conv3d``, ``ConvTranspose3d``, ``MaxPool3d``,
    ``AvgPool3d``, ``BatchNorm3d``, ``Upsample`` and ``AdaptiveAvgPool3d(1)`` become their
    spatial twins (sharing the copy's parameters); pointwise layers stay; a module with a
    ``spatial_twin(grid)`` method is replaced by what it returns. Layers after a gather point
    or a global pool run replicated and their parameters are tagged data-only. The result
    equals the plain model on the whole volume (outputs, and gradients once summed over the
    spatial group).

    Args:
        model: The plain model; it is deep-copied, not modified.
        grid: The process grid whose x, y, z axes split every sample's volume.
        bn_include_data: Batch-norm statistics also cover the data group (what one
            BatchNorm on the whole global batch computes).

    Returns:
        The spatialized copy.

    Raises:
        LayerError: A layer needs the whole volume while its input is still split (the
            message names it and says where to put a gather point or global pool).

    Example:
        ```python
        model = spatialize(CosmoFlow.small(input_size=32), grid)
        y = model(spatial.scatter(cube, grid))
        ```
    """
    model = copy.deepcopy(model)
    walker = _Walker(grid, bn_include_data)
    new, _ = walker.one(model, PARTITIONED, "")
    return new
