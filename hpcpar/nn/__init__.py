"""Distributed layers: spatial (halo-exchanging) 3D layers, tensor-parallel dense layers and
distributed graph layers. Each spatial layer takes its torch twin's arguments plus ``grid=``
and has the same state_dict keys and shapes. Names load lazily (importing layers pulls torch).

May import: hpcpar.errors, hpcpar.parallel, hpcpar.sync, hpcpar.graph, hpcpar.kernels.
"""

from .._lazy import lazy_getattr

_MODULES = {   # module of hpcpar.nn -> the names it gives the package
    "conv": ("SpatialConv3d", "SpatialConvTranspose3d"),
    "pool": ("SpatialMaxPool3d", "SpatialAvgPool3d"),
    "norm": ("SpatialBatchNorm3d",), "upsample": ("SpatialUpsample",),
    "gather": ("SpatialAdaptiveAvgPool3d", "SpatialGather"),
    "spatializer": ("spatialize", "settle"),
    "split": ("SplitTensor", "local", "whole", "is_split", "split_like"),
    "reduce": ("global_reduce",), "dropout": ("spatial_dropout",),
    "custom_functions": ("local_function",),
    "tensor_parallel": ("TensorParallelLinear", "tensor_parallelize"),
    "graph": ("DistGCNConv", "DistSAGEConv"),
}
_LAZY = {name: f"hpcpar.nn.{m}" for m, names in _MODULES.items() for name in names}

__getattr__ = lazy_getattr("hpcpar.nn", _LAZY)

__all__ = sorted(_LAZY)
