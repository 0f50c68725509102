"""Reductions over a split volume that give the single-process value, replicated.

A reduction whose ``dim`` covers every split spatial axis (an axis a with
``grid.spatial_shape[a] > 1``) is a global reduction: each rank reduces its piece, one allreduce
over ``grid.spatial_comm`` combines the pieces, and every spatial rank holds torch's result on the
whole tensor. One that reduces no split axis is local (exact as it is); one that reduces some split
axes but not all would leave a result split over a partial set of axes and is refused.

Convention: "allreduce in forward, identity in backward" (the replicated result's upstream
gradient is the same on every rank, so each rank's input gradient is its own slice of torch's).

    sum    Σx                                    one allreduce
    mean   Σx / M                                M = product of the GLOBAL sizes of ``dim``
    var    Σ(x - mean)² / max(M - correction, 0)  two allreduces: global mean, then the
           squared deviations from it (two-pass, numerically sound); torch's ``correction``
    std    sqrt(var)
    norm   sqrt(Σx²)                             the 2-norm (``torch.linalg.vector_norm``)
    amax   max x  (amin: min x)                  backward: the gradient split evenly over all
                                                 tied extremes of the whole tensor (torch's rule)

Dim 0 (the batch) is never split spatially: reducing it covers this data group's samples only,
as the single-process model on that group's batch would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.primitives import GlobalExtreme, ReplicatedSum, SquaredDeviation
from hpcpar.parallel.spatial import local_shape

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["REDUCTIONS", "split_dims", "global_reduce"]

REDUCTIONS = ("sum", "mean", "amax", "amin", "var", "std", "norm")


def split_dims(grid: ProcessGrid, ndim: int = 5) -> tuple[int, ...]:
    """The dims of an ``ndim``-D tensor (last three spatial) split over more than one rank."""
    return tuple(ndim - 3 + a for a, p in enumerate(grid.spatial_shape) if p > 1)


class _MaskedSqrt(torch.autograd.Function):
    """sqrt with gradient 0 where it is 0, as torch's std and norm backward (not inf·0 = nan)."""

    @staticmethod
    def forward(ctx, t):
        root = t.sqrt()
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx, grad):
        (root,) = ctx.saved_tensors
        return (grad / (2 * root)).masked_fill_(root == 0, 0)


def _dims(op: str, ndim: int, dim: int | Sequence[int] | None) -> tuple[int, ...]:
    """``dim`` as sorted non-negative dims (None or () = all, torch's rule)."""
    raw = (dim,) if isinstance(dim, int) else tuple(range(ndim)) if not dim else tuple(dim)
    if any(not -ndim <= d < ndim for d in raw):
        raise LayerError(f"global_reduce {op}: dim {dim!r} is out of range for a {ndim}D "
                         f"tensor (expected dims in [{-ndim}, {ndim - 1}])")
    dims = tuple(sorted(d % ndim for d in raw))
    if len(set(dims)) != len(dims):
        raise LayerError(f"global_reduce {op}: dim {dim!r} repeats a dim")
    return dims


def global_reduce(x: torch.Tensor, op: str, dim: int | Sequence[int] | None = None,
                  keepdim: bool = False, *, grid: ProcessGrid, gshape: Sequence[int],
                  correction: int | float = 1) -> torch.Tensor:
    """torch's ``x.<op>(dim, keepdim)`` on the whole tensor, from this rank's piece ``x`` of the
    global ``(N, C, *gshape)`` tensor (collective over ``grid.spatial_comm``).

    ``op`` is one of :data:`REDUCTIONS` (``"norm"``: the 2-norm); ``dim`` None reduces all (a 0-d
    result); ``correction`` is torch's, for ``var``/``std`` (1: unbiased, 0: population). When
    ``dim`` covers every split spatial axis the result is torch's on the whole tensor, identical on
    every spatial rank; when it covers none, this rank's piece of it. LayerError: an unknown op, a
    bad ``dim``, a ``dim`` that reduces some split axes but not all, or a piece whose shape is not
    this rank's piece of ``gshape``."""
    if op not in REDUCTIONS:
        raise LayerError(f"global_reduce: unknown op {op!r} (expected one of "
                         f"{', '.join(REDUCTIONS)})")
    dims = _dims(op, x.dim(), dim)
    split = split_dims(grid, x.dim())
    reduced = [d for d in split if d in dims]
    if not reduced:   # torch's own op on the piece: exact when no reduced dim is split
        if op in ("var", "std"):
            return getattr(torch, op)(x, dims, correction=correction, keepdim=keepdim)
        if op == "norm":
            return torch.linalg.vector_norm(x, 2, dims, keepdim)
        return getattr(torch, op)(x, dims, keepdim=keepdim)
    if len(reduced) != len(split):
        kept = [d for d in split if d not in dims]
        raise LayerError(f"global_reduce {op}: dim {tuple(dims)} of a tensor split over dims "
                         f"{split} (grid {grid.spec()}) reduces split dim(s) {tuple(reduced)} "
                         f"but not {tuple(kept)}: reduce over all of (2, 3, 4), or gather first")
    glob = (*x.shape[:-3], *(int(n) for n in gshape))
    if len(gshape) != 3 or tuple(x.shape) != local_shape(glob, grid):
        raise LayerError(f"global_reduce {op}: input {tuple(x.shape)} is not this rank's "
                         f"piece of global spatial shape {tuple(gshape)} on grid {grid.spec()}")
    comm = grid.spatial_comm
    count = math.prod(glob[d] for d in dims)
    out = _global(x, op, dims, count, correction, comm)
    return out if keepdim else out.squeeze(dims)


def _global(x: torch.Tensor, op: str, dims: tuple[int, ...], count: int,
            correction: int | float, comm: MPI.Comm) -> torch.Tensor:
    """The replicated reduction, keepdim, in x's dtype."""
    if op in ("amax", "amin"):
        return GlobalExtreme.apply(x, dims, op, comm)
    if op in ("var", "std"):
        out = SquaredDeviation.apply(x, dims, count, comm) / max(count - correction, 0)
    else:
        terms = x.square() if op == "norm" else x
        # floating sums of partial sums accumulate in float64; integers keep torch's promotion
        acc = torch.float64 if x.dtype.is_floating_point else None
        out = ReplicatedSum.apply(terms.sum(dims, keepdim=True, dtype=acc), comm)
        if op == "mean":
            out = out / count
    if op in ("std", "norm"):
        out = _MaskedSqrt.apply(out)
    return out.to(x.dtype) if x.dtype.is_floating_point else out
