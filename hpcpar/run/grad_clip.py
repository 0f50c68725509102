"""``[train] clip_grad_norm``: clip by the global 2-norm of the single-process model's gradient.

After the gradient sync every rank holds complete gradients, but of pieces: a replicated
parameter (spatial or data copies) is one parameter, a tensor-parallel shard is a piece of
one. The norm is ``torch.nn.utils.clip_grad_norm_``'s on the single-process model, so each
piece must count exactly once over all ranks: :func:`norm_share` picks this rank's share, whose
sum of squares the loop adds to its one per-step allreduce (no extra message), and
:func:`clip_` scales every local gradient by torch's coefficient ``max / (norm + 1e-6)``
when it is below one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["norm_share", "spatial_share", "squared_norm", "clip_"]

#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm
EPS = 1e-6


def norm_share(model: torch.nn.Module, grid: ProcessGrid) -> list[torch.nn.Parameter]:
    """The parameters whose gradients this rank counts in the global norm.

    Data replicas hold equal gradients after the sync, so only data index 0 counts. Inside it
    a replicated parameter counts on spatial rank 0; a ``TensorParallelLinear`` weight shard
    counts where the layer says its piece is this rank's own
    (``TensorParallelLinear.owns_piece``); a split head's weight (cut to this rank's columns,
    :mod:`hpcpar.nn.split_head`) counts on every spatial rank."""
    if grid.coords[0] != 0:
        return []
    counted = spatial_share(model, grid)
    model = getattr(model, "module", model)
    return [p for p in model.parameters() if p.requires_grad and counted(p)]


def spatial_share(model: torch.nn.Module, grid: ProcessGrid):
    """Whether this rank counts a parameter among the ranks of its data index (see
    :func:`norm_share`); with ``[train] shard_optimizer`` it picks the pieces of the
    parameters sharded over the data axis only. Returns a predicate on parameters."""
    from hpcpar.nn.split_head import column_split  # deferred: loads torch, numpy
    from hpcpar.nn.tensor_parallel import TensorParallelLinear  # deferred: loads torch, numpy

    model = getattr(model, "module", model)
    pieces = {id(p): mod.owns_piece(p) for mod in model.modules()
              if isinstance(mod, TensorParallelLinear) for p in mod.parameters(recurse=False)}
    pieces.update((id(p), True) for p in model.parameters() if column_split(p) is not None)
    first = not any(grid.spatial_coords)
    return lambda p: pieces.get(id(p), first)


def squared_norm(params: list[torch.nn.Parameter]) -> float:
    """Sum of the squared gradient entries of ``params`` in float64 (a missing grad is zero;
    inf or NaN when a gradient is not finite)."""
    import torch

    norms = [torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64)
             for p in params if p.grad is not None]
    return float(torch.stack(norms).square().sum()) if norms else 0.0


def clip_(params, max_norm: float, total_norm: float) -> None:
    """Scale every gradient of ``params`` in place by ``max_norm / (total_norm + 1e-6)`` when
    that is below one (``total_norm``: the global norm before clipping)."""
    import torch

    coef = max_norm / (total_norm + EPS)
    grads = [p.grad for p in params if p.grad is not None]
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)
