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

__all__ = ["REDUCE_ATTR", "TAGS_VERSION", "DATA_ONLY", "tag_data_only", "reduce_scope", "copy_tags"]

REDUCE_ATTR = "hpcpar_reduce"
#: A model attribute bumped whenever its parameters' tags change (a spatialized model learns
#: them from its forward's dataflow); the gradient sync re-plans its buckets then.
TAGS_VERSION = "_hpcpar_tags_version"
SPATIAL_AND_DATA = "spatial+data"
DATA_ONLY = "data"


def tag_data_only(param: torch.nn.Parameter) -> None:
    """Mark a parameter so the gradient sync averages it over the data axis only.

    For tensor-parallel shards and layers computed redundantly on every rank of a spatial
    group (after a gather or a global pool); ``spatialize`` and ``TensorParallelLinear`` tag
    theirs (an attribute is set on the parameter).
    """
    setattr(param, REDUCE_ATTR, DATA_ONLY)


def reduce_scope(param: torch.nn.Parameter) -> str:
    """How the gradient sync reduces a parameter: ``"spatial+data"`` (the default: sum over
    the spatial group, average over data) or ``"data"`` (average over the data axis only)."""
    return getattr(param, REDUCE_ATTR, SPATIAL_AND_DATA)


def copy_tags(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Give ``dst``'s parameters the tags of ``src``'s parameters of the same name.

    torch's ``Parameter.__deepcopy__`` keeps data and ``requires_grad`` but not attributes,
    so a deep copy of a spatialized model would silently lose the data-only tags of its
    replicated layers, and the sync would then sum their full gradients over the spatial
    group (``spatial`` times too large).
    """
    tagged = {name: getattr(p, REDUCE_ATTR) for name, p in src.named_parameters()
              if hasattr(p, REDUCE_ATTR)}
    for name, p in dst.named_parameters():
        if name in tagged:
            setattr(p, REDUCE_ATTR, tagged[name])
