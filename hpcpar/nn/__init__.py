"""Distributed layers: spatial (halo-exchanging) 3D layers, tensor-parallel dense layers and
distributed graph layers. Each spatial layer takes its torch twin's arguments plus ``grid=``
and has the same state_dict keys and shapes. Names load lazily (importing layers pulls torch).

May import: hpcpar.errors, hpcpar.parallel, hpcpar.sync, hpcpar.graph, hpcpar.kernels.
"""

from .._lazy import lazy_getattr

_LAZY = {
    # spatial CNN layers
    "SpatialConv3d": "hpcpar.nn.conv",
    "SpatialConvTranspose3d": "hpcpar.nn.conv",
    "SpatialMaxPool3d": "hpcpar.nn.pool",
    "SpatialAvgPool3d": "hpcpar.nn.pool",
    "SpatialBatchNorm3d": "hpcpar.nn.norm",
    "SpatialUpsample": "hpcpar.nn.upsample",
    "SpatialAdaptiveAvgPool3d": "hpcpar.nn.gather",
    "SpatialGather": "hpcpar.nn.gather",
    "spatialize": "hpcpar.nn.spatializer",
    "settle": "hpcpar.nn.spatializer",
    "SplitTensor": "hpcpar.nn.split",
    "local": "hpcpar.nn.split",
    "whole": "hpcpar.nn.split",
    "is_split": "hpcpar.nn.split",
    "split_like": "hpcpar.nn.split",
    "global_reduce": "hpcpar.nn.reduce",
    "spatial_dropout": "hpcpar.nn.dropout",
    "local_function": "hpcpar.nn.custom_functions",
    # tensor parallelism
    "TensorParallelLinear": "hpcpar.nn.tensor_parallel",
    "tensor_parallelize": "hpcpar.nn.tensor_parallel",
    # graphs
    "DistGCNConv": "hpcpar.nn.graph",
    "DistSAGEConv": "hpcpar.nn.graph",
}


__getattr__ = lazy_getattr("hpcpar.nn", _LAZY)


__all__ = sorted(_LAZY)
