"""Group, instance and layer normalisation of split volumes, with statistics over the WHOLE
sample: the functional twins of ``F.group_norm``, ``F.instance_norm`` and ``F.layer_norm``.

Each norm standardises rows: one row per (sample, group) for group norm, per (sample, channel)
for instance norm, per leading index for layer norm, each row spread over the ranks of
``grid.spatial_comm``. With M the GLOBAL count of a row and x̂ = (x - mean) / sqrt(var + eps):

    forward   every rank sends its (count, mean, M2) per row (torch's one-pass Welford,
              locally), and all merge them in rank order with Chan's formula
              mean = Σ m_r mean_r / M,  M2 = Σ M2_r + Σ m_r (mean_r - mean)²,  var = M2 / M
              (no Σx² cancellation; the same bits on every rank);   y = γ x̂ + β
    backward  g = γ dy;  one allreduce of (Σg, Σg·x̂) per row;
              dx = (g - Σg / M - x̂ · Σg·x̂ / M) / sqrt(var + eps)
              dγ, dβ = Σ_local dy·x̂, Σ_local dy   (partial: the gradient sync sums them)

Rows are this rank's piece seen through a view (group norm splits C into (G, C/G)), so both
memory formats work without copies. Statistics accumulate in float64 for float64 inputs, else in
float32 (half types included).

Each function takes this rank's ``(N, C, d, h, w)`` piece ``x`` (the output keeps its memory
format) and the global spatial shape ``gshape`` ``(D, H, W)``; collective over
``grid.spatial_comm``. ``weight``/``bias`` are replicated, their gradients this rank's partial
ones. LayerError where ``x`` is not this rank's piece of ``gshape`` (on every rank where a
collective follows) or an affine tensor has the wrong shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hpcpar.errors import LayerError
from hpcpar.parallel.comm import allgather, allreduce_
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo_buffers import input_layout, memory_format
from hpcpar.parallel.spatial import local_shape, local_slices

from ._functional import acc_dtype

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["group_norm", "instance_norm", "layer_norm"]


def _check_dims(op: str, x: torch.Tensor) -> None:
    if x.dim() != 5:
        raise LayerError(f"{op}: expected this rank's (N, C, d, h, w) piece of a split volume, "
                         f"got shape {tuple(x.shape)}")


def _piece_error(op: str, x: torch.Tensor, grid: ProcessGrid, gshape: Sequence[int]) -> str:
    """Why ``x`` is not this rank's part of ``gshape``; "" when it is."""
    want = local_shape((*x.shape[:2], *gshape), grid)
    if tuple(x.shape) == want:
        return ""
    return (f"{op}: local piece {tuple(x.shape)} is not this rank's part {want} of the global "
            f"volume {tuple(gshape)} on grid {grid.spec()}; pass the global spatial shape as "
            "gshape")


class _Rows(NamedTuple):
    """``x.view(view)`` reduced over ``dims`` gives one statistic per row; ``where`` names the op
    for errors; ``on_stats(mean, var)`` (float64, per row) sees the merged statistics."""

    view: tuple[int, ...]
    dims: tuple[int, ...]
    eps: float
    comm: MPI.Comm
    where: str
    piece_ok: bool
    on_stats: Callable | None = None


def _rows(op: str, x: torch.Tensor, grid: ProcessGrid, gshape: Sequence[int],
          view: Sequence[int], dims: Sequence[int], eps: float,
          on_stats: Callable | None = None) -> _Rows:
    where = f"{op} over the global volume {tuple(gshape)} on grid {grid.spec()}"
    return _Rows(tuple(view), tuple(dims), eps, grid.spatial_comm, where,
                 not _piece_error(op, x, grid, gshape), on_stats)


def _merge_moments(var: torch.Tensor, mean: torch.Tensor, count: int, rows: _Rows):
    """Global (mean, biased var, count) per row (Chan et al. in float64, in rank order: the same
    bits everywhere). The allgather also carries each rank's piece check, so a bad piece on SOME
    ranks is refused by ALL of them (no rank is left waiting in a collective)."""
    n = mean.numel()
    head = torch.tensor([float(count), float(rows.piece_ok)], dtype=torch.float64,
                        device=mean.device)
    mine = torch.cat([head, mean.reshape(-1).double(), var.reshape(-1).double() * count])
    every = allgather(mine, rows.comm)                  # (P, 2 + 2 n)
    bad = (every[:, 1] == 0).nonzero().flatten().tolist()
    if bad:
        raise LayerError(f"{rows.where}: the local pieces of spatial ranks {bad} are not their "
                         "parts of it; pass the global spatial shape as gshape")
    m, means, m2s = every[:, :1], every[:, 2:2 + n], every[:, 2 + n:]
    total = m.sum(0)
    gmean = (m * means).sum(0) / total
    m2 = m2s.sum(0) + (m * (means - gmean).square()).sum(0)
    return gmean.view(mean.shape), (m2 / total).view(mean.shape), int(total.item())


class _GlobalNorm(torch.autograd.Function):
    """y = γ x̂ + β over ``rows`` (module docstring); ``weight``/``bias`` broadcast to its view."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows):
        acc = acc_dtype(x.dtype)
        fmt = memory_format(input_layout(x))
        base = x.detach().to(acc)
        xa = base.view(rows.view)
        count = math.prod(xa.shape[d] for d in rows.dims)
        var, mean = torch.var_mean(xa, dim=rows.dims, correction=0, keepdim=True)
        mean, var, ctx.count = _merge_moments(var, mean, count, rows)
        if rows.on_stats is not None:
            rows.on_stats(mean, var)
        mean, rstd = mean.to(acc), torch.rsqrt(var + rows.eps).to(acc)
        # the output owns its storage, shaped like x: a view made here could not be changed in
        # place after the norm (autograd forbids it; nn.ReLU(inplace=True) after a GroupNorm,
        # as MONAI's SegResNet and DynUNet write it, would fail)
        out = torch.empty_like(base)
        try:
            y = out.view(rows.view)
        except RuntimeError:   # a piece that is not dense: computed aside
            y = None
        y = torch.sub(xa, mean, out=y).mul_(rstd)
        if weight is not None:
            y.mul_(weight.detach().to(acc))
        if bias is not None:
            y.add_(bias.detach().to(acc))
        if y.data_ptr() != out.data_ptr():
            out.copy_(y.reshape(x.shape))
        # x as a plain alias: a split tensor's piece (hpcpar.nn.split) would send every op
        # of the backward through its __torch_function__
        ctx.save_for_backward(x.detach(), weight, mean, rstd)
        ctx.rows, ctx.fmt = rows, fmt
        ctx.bias = None if bias is None else (bias.shape, bias.dtype)
        return out.to(x.dtype).contiguous(memory_format=fmt)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        acc, dims, view = mean.dtype, ctx.rows.dims, ctx.rows.view
        xa = x.to(acc).view(view)
        # dense in x's memory order (an expanded or differently laid out dy is copied once)
        dya = dy.to(acc).contiguous(memory_format=ctx.fmt).view(view)
        xhat = torch.sub(xa, mean).mul_(rstd)
        w = weight.detach().to(acc) if weight is not None else None
        d_weight = d_bias = dx = None
        if weight is not None and ctx.needs_input_grad[1]:
            d_weight = (dya * xhat).sum_to_size(weight.shape).to(weight.dtype)
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            d_bias = dya.sum_to_size(ctx.bias[0]).to(ctx.bias[1])
        if ctx.needs_input_grad[0]:
            g = dya * w if w is not None else dya
            sums = torch.stack([g.sum(dims, keepdim=True), (g * xhat).sum(dims, keepdim=True)])
            total = allreduce_(sums.double(), ctx.rows.comm)
            mean_g, mean_gx = (total / ctx.count).to(acc)
            dx = xhat.mul_(-mean_gx).add_(g).sub_(mean_g).mul_(rstd)
            dx = dx.reshape(x.shape).to(x.dtype).contiguous(memory_format=ctx.fmt)
        return dx, d_weight, d_bias, None


def _check_shapes(op: str, shape: tuple[int, ...], **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != shape:
            raise LayerError(f"{op}: {name} has shape {tuple(t.shape)}, expected {shape}")


def _view(t: torch.Tensor | None, shape: Sequence[int]) -> torch.Tensor | None:
    return None if t is None else t.view(shape)


def _local(op: str, x: torch.Tensor, grid: ProcessGrid, gshape: Sequence[int],
           norm: Callable[[], torch.Tensor]) -> torch.Tensor:
    """torch's local ``norm()`` in ``x``'s memory format (torch's is contiguous); the piece is
    checked here, as no collective follows (no rank can be left waiting)."""
    error = _piece_error(op, x, grid, gshape)
    if error:
        raise LayerError(error)
    return norm().contiguous(memory_format=memory_format(input_layout(x)))


def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, grid: ProcessGrid,
               gshape: Sequence[int]) -> torch.Tensor:
    """``F.group_norm`` of the whole sample: statistics per (sample, group) over its C/G channels
    and all D·H·W voxels. ``weight``/``bias``: ``(C,)``; LayerError where G does not divide C."""
    op = "group_norm"
    _check_dims(op, x)
    n, c = x.shape[:2]
    if num_groups <= 0 or c % num_groups:
        raise LayerError(f"group_norm: {c} channels do not split into num_groups={num_groups} "
                         "equal groups; use a divisor of the channel count")
    _check_shapes(op, (c,), weight=weight, bias=bias)
    per_channel = (1, num_groups, c // num_groups, 1, 1, 1)
    rows = _rows(op, x, grid, gshape, (n, num_groups, c // num_groups, *x.shape[2:]),
                 (2, 3, 4, 5), eps)
    return _GlobalNorm.apply(x, _view(weight, per_channel), _view(bias, per_channel), rows)


def instance_norm(x: torch.Tensor, running_mean: torch.Tensor | None = None,
                  running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5, *, grid: ProcessGrid,
                  gshape: Sequence[int], include_data: bool = False) -> torch.Tensor:
    """``F.instance_norm`` of the whole sample (what ``nn.InstanceNorm3d`` calls): each (sample,
    channel) is normalised with its statistics over all D·H·W voxels. ``weight``, ``bias`` and
    the running buffers are ``(C,)``; the buffers come both or neither.

    With ``use_input_stats`` (training, or untracked), running buffers are updated in place as
    torch does (batch mean of the per-sample means and unbiased variances over the global voxel
    count), identically on every rank; with ``include_data`` over the whole global batch
    (``grid.data_comm`` too). Without (eval with tracked statistics) they normalise locally, no
    communication. LayerError also for a one-voxel volume in training, one running buffer alone,
    none in eval, or a running buffer of the wrong shape."""
    op = "instance_norm"
    _check_dims(op, x)
    n, c = x.shape[:2]
    _check_shapes(op, (c,), weight=weight, bias=bias)
    if (running_mean is None) != (running_var is None):
        raise LayerError(f"{op}: pass both running_mean and running_var, or neither")
    _check_shapes(op, (c,), running_mean=running_mean, running_var=running_var)
    if not use_input_stats:
        if running_mean is None:
            raise LayerError(f"{op}: use_input_stats=False needs running_mean and running_var "
                             "(track_running_stats=True)")
        return _local(op, x, grid, gshape, lambda: F.instance_norm(
            x, running_mean, running_var, weight, bias, False, momentum, eps))
    count = math.prod(gshape)
    if count <= 1:
        raise LayerError(f"{op}: expected more than 1 voxel per channel when training, got "
                         f"global volume {tuple(gshape)}")

    def update_running(mean, var):
        with torch.no_grad():
            unbiased = var * (count / (count - 1))
            sums = torch.cat([mean.view(n, c).sum(0), unbiased.view(n, c).sum(0),
                              mean.new_full((1,), n)]).double()
            if include_data and grid.data > 1:
                allreduce_(sums, grid.data_comm)
            for buf, stat in ((running_mean, sums[:c]), (running_var, sums[c:2 * c])):
                buf.mul_(1 - momentum).add_(momentum * (stat / sums[-1]).to(buf.dtype))

    per_channel = (1, c, 1, 1, 1)
    rows = _rows(op, x, grid, gshape, x.shape, (2, 3, 4), eps,
                 update_running if running_mean is not None else None)
    return _GlobalNorm.apply(x, _view(weight, per_channel), _view(bias, per_channel), rows)


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, *, grid: ProcessGrid, gshape: Sequence[int]) -> torch.Tensor:
    """``F.layer_norm`` of the whole sample, ``normalized_shape`` (and the elementwise
    ``weight``/``bias``'s shape) in GLOBAL sizes of the trailing dims.

    Trailing dims that hold every split axis, e.g. ``(C, D, H, W)`` or ``(D, H, W)``: each
    leading index is normalised with its statistics over the whole sample, and this rank applies
    its own slice of ``weight``/``bias`` (their gradients are zero outside it). Trailing dims
    that hold no split axis (``(W,)`` when W is not split) are plain local ``F.layer_norm``.
    LayerError also where ``normalized_shape`` is not a trailing part of the global shape, or
    holds some split axes but not all (its statistics would need a sub-group of the ranks)."""
    op = "layer_norm"
    _check_dims(op, x)
    full = (*x.shape[:2], *gshape)
    dims = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(dims)
    if not 1 <= k <= len(full) or dims != full[-k:]:
        raise LayerError(f"{op}: normalized_shape {dims} is not the trailing part of the global "
                         f"input shape {full}")
    _check_shapes(op, dims, weight=weight, bias=bias)
    first = len(full) - k                                  # first normalised dim
    split = {2 + a: p > 1 for a, p in enumerate(grid.spatial_shape)}
    if not any(s for d, s in split.items() if d >= first):
        return _local(op, x, grid, gshape, lambda: F.layer_norm(x, dims, weight, bias, eps))
    outside = [d for d, s in split.items() if s and d < first]
    if outside:
        raise LayerError(f"{op}: normalized_shape {dims} leaves out dim {outside[-1]} of the "
                         f"input, which grid {grid.spec()} splits; normalise over "
                         f"{full[outside[-1]:]} or do not split that axis")
    own = local_slices(full, grid)[first:]
    rows = _rows(op, x, grid, gshape, x.shape, range(first, len(full)), eps)
    return _GlobalNorm.apply(x, None if weight is None else weight[own],
                             None if bias is None else bias[own], rows)
