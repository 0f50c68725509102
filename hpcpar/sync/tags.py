"""How each parameter's gradient is reduced by the gradient sync.

Default (``"spatial+data"``): the parameter is replicated and each rank's gradient is the
partial gradient of its own sub-volume; the sync SUMS over the spatial group and AVERAGES over
the data group. ``"data"``: the gradient is already complete on each rank of the spatial group
(tensor-parallel shards, or layers computed redundantly on gathered/globally pooled data); the
sync only AVERAGES over the data axis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["REDUCE_ATTR", "SPATIAL_AND_DATA", "DATA_ONLY", "tag_data_only", "reduce_scope"]

REDUCE_ATTR = "hpcpar_reduce"
SPATIAL_AND_DATA = "spatial+data"
DATA_ONLY = "data"


def tag_data_only(param: torch.nn.Parameter) -> None:
    """Mark a parameter so the gradient sync averages it over the data axis only.

    For tensor-parallel shards and layers computed redundantly on every rank of a spatial
    group (after a gather or a global pool); ``spatialize`` and ``TensorParallelLinear`` tag
    theirs.

    Args:
        param: The parameter to tag (an attribute is set on it).
    """
    setattr(param, REDUCE_ATTR, DATA_ONLY)


def reduce_scope(param: torch.nn.Parameter) -> str:
    """How the gradient sync reduces a parameter.

    Args:
        param: The parameter.

    Returns:
        ``"spatial+data"`` (the default: sum over the spatial group, average over data) or
        ``"data"`` (average over the data axis only).
    """
    return getattr(param, REDUCE_ATTR, SPATIAL_AND_DATA)
