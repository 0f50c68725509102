"""Batch normalisation with statistics over the whole (partitioned) volume.

Per channel, over N·D·H·W voxels of the spatial group (and of the data group with
``include_data=True``, i.e. what one BatchNorm on the whole global batch would see):

    forward   mean = Σx / M,  var = Σ(x - mean)² / M   (two allreduces: exact two-pass sums)
              x̂ = (x - mean) / sqrt(var + eps),  y = γ x̂ + β
    backward  dx = γ / sqrt(var + eps) · (dy - Σdy / M - x̂ · Σ(dy x̂) / M)   (one allreduce)
              dγ = Σ_local dy x̂,  dβ = Σ_local dy   (partial: the gradient sync sums them)

M is the global count. Running statistics are updated from the global mean and unbiased
variance, so they are the same on every rank and equal to torch's on the whole batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.errors import LayerError
from hpcpar.parallel.comm import allreduce_
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo_buffers import input_layout, memory_format

from ._base import SpatialModule
from ._functional import acc_dtype

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["SpatialBatchNorm3d"]


class _GlobalBatchNorm(torch.autograd.Function):
    """The maths of the module docstring; every full-volume pass is one of torch's fused
    batch-norm kernels fed the global statistics (eval-mode forward for the output, its
    backward for Σdy and Σdy·x̂), so the only full-size temporaries are the output and dx:
    the step's memory traffic, not the per-channel sums, is what costs on a CPU."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, comm, name,
                owned=None):
        # owned: the region of x this rank owns when x also holds a fused run's margin
        # (hpcpar.nn.fused_halo): the statistics are of owned voxels only, every voxel is
        # normalised, and in backward a margin voxel's gradient is only its direct part (its
        # share of the statistics' gradient reaches the owner through the sums)
        acc = acc_dtype(x.dtype)
        C = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        view = (1, C) + (1,) * (x.dim() - 2)
        xa = x.detach().to(acc)
        xs = xa if owned is None else xa[owned]
        # float64 on the wire: sums of many partial sums, and counts above 2**24 stay exact
        first = torch.empty(C + 1, dtype=torch.float64, device=x.device)
        first[:C] = xs.sum(dims)
        first[C] = xs.numel() // C if C else 0
        allreduce_(first, comm)
        count = int(round(first[C].item()))
        if count <= 1:
            raise LayerError(f"{name}: expected more than 1 value per channel when training, "
                             f"got {count} over the whole group (input {tuple(x.shape)})")
        mean = (first[:C] / count).to(acc)
        m2 = (xs - mean.view(view)).square_().sum(dims).double()   # two-pass: exact
        allreduce_(m2, comm)
        var = m2 / count
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
                unbiased = var * (count / (count - 1))
                running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))
        var = var.to(acc)
        w = weight.detach().to(acc) if weight is not None else None
        b = bias.detach().to(acc) if bias is not None else None
        y = F.batch_norm(xa, mean, var, w, b, False, 0.0, eps)   # (x - mean)/std * w + b
        # x as a plain alias: a split tensor's piece (hpcpar.nn.split) would send every op
        # of the backward through its __torch_function__ (~2 us each, ten per call)
        ctx.save_for_backward(x.detach(), weight, mean, var)
        ctx.count, ctx.comm, ctx.eps, ctx.owned = count, comm, eps, owned
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, var = ctx.saved_tensors
        acc = mean.dtype
        C = x.shape[1]
        view = (1, C) + (1,) * (x.dim() - 2)
        # dense in x's memory order (an expanded or differently laid out dy is copied once)
        fmt = memory_format(input_layout(x))
        xa, dya = x.to(acc), dy.to(acc).contiguous(memory_format=fmt)
        w = weight.detach().to(acc) if weight is not None else torch.ones_like(mean)
        # eval-mode backward with the global statistics: its weight and bias gradients are
        # this sub-volume's Σ dy·x̂ and Σ dy, in one fused pass. Empty saved statistics say
        # "use the running ones" on CUDA too (None trips an internal assert there)
        unsaved = mean.new_empty(0)
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dya, xa, w, mean, var, unsaved, unsaved, False, ctx.eps, [False, True, True])
        sums = torch.stack([sum_dy, sum_dy_xhat])                  # partial, this sub-volume
        d_weight = sums[1].to(weight.dtype) if weight is not None else None
        d_bias = sums[0].to(weight.dtype) if ctx.has_bias else None
        dx = None
        if ctx.needs_input_grad[0]:
            total = allreduce_(sums.to(torch.float64, copy=True), ctx.comm)
            mean_dy, mean_dy_xhat = (total / ctx.count).to(acc)
            scale = torch.rsqrt(var + ctx.eps) * w
            # dx = scale·(dy - mean_dy - x̂·mean_dy_xhat): the x̂ part is one eval-mode pass
            own = ctx.owned
            part = F.batch_norm(xa if own is None else xa[own], mean, var,
                                -scale * mean_dy_xhat, -scale * mean_dy, False, 0.0, ctx.eps)
            if own is None:
                dx = part.addcmul_(dya, scale.view(view)).to(x.dtype)
            else:   # margin voxels: the direct part only (see forward)
                dx = dya * scale.view(view)
                dx[own] += part
                dx = dx.to(x.dtype)
        return dx, d_weight, d_bias, None, None, None, None, None, None, None


class SpatialBatchNorm3d(SpatialModule, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` whose batch statistics cover the whole volume of the spatial group
    (``include_data=True``: also every sample of the data group; ``grid``'s x, y, z axes split the
    volume): exactly ``nn.BatchNorm3d`` on the whole volume (or global batch), by the module
    docstring's allreduces. Same arguments, state_dict and running statistics as torch's; eval mode
    is purely local."""

    def __init__(self, num_features: int, eps: float = 1e-05, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 grid: ProcessGrid, include_data: bool = False):
        nn.BatchNorm3d.__init__(self, num_features, eps, momentum, affine, track_running_stats,
                                device, dtype)
        self.init_spatial(grid)
        self.include_data = include_data

    @property
    def comm(self) -> MPI.Comm:
        """The communicator of the statistics: the spatial group (all ranks: include_data)."""
        return self.grid.comm if self.include_data else self.grid.spatial_comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise this rank's piece: whole-volume statistics in training, else running ones."""
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not batch_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        update = self.training and self.running_mean is not None
        return _GlobalBatchNorm.apply(
            x, self.weight, self.bias, self.running_mean if update else None,
            self.running_var if update else None, factor, self.eps, self.comm,
            type(self).__name__)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", include_data={self.include_data}"
