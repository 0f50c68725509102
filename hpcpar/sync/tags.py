"""How each parameter's gradient is reduced by the gradient sync.

Default (``"spatial+data"``): the parameter is replicated and each rank's gradient is the
partial gradient of its own sub-volume; the sync SUMS over the spatial group and AVERAGES over
the data group. ``"data"``: the gradient is already complete on each rank of the spatial group
(tensor-parallel shards, or layers computed redundantly on gathered/globally pooled data); the
sync only AVERAGES over the data axis.
"""

from __future__ import annotations

REDUCE_ATTR = "hpcpar_reduce"
SPATIAL_AND_DATA = "spatial+data"
DATA_ONLY = "data"


def tag_data_only(param) -> None:
    """Mark ``param`` so the gradient sync reduces it over the data axis only."""
    setattr(param, REDUCE_ATTR, DATA_ONLY)


def reduce_scope(param) -> str:
    """``"spatial+data"`` (default) or ``"data"``."""
    return getattr(param, REDUCE_ATTR, SPATIAL_AND_DATA)
