"""4D tensor parallelism for dense layers (the AxoNN scheme on the hpcpar grid).

``Y = X·Wᵀ + b`` inside one data group of the grid, with W (out × in) split in 3D:
input features over **x**, output features over **y**, and each (y, x) block's rows stored
sharded over **z**; the batch rows are split over **z** while computing.

forward   X_zx = X[batch_z, in_x]            (slice of the replicated input)
          W_yx = allgather_z(W_shard)         (the block, rebuilt for the GEMM)
          Y_zy = allreduce_x(X_zx · W_yxᵀ) + b_y
          Y    = allgather over y (features) and z (batch rows)
backward  dY_zy = dY[batch_z, out_y]          (downstream is replicated: take my slice)
          dX_zx = allreduce_y(dY_zy · W_yx);  dX = allgather over x and z
          dW_shard = reduce_scatter_z(dY_zyᵀ · X_zx);  db_y = allreduce_z(Σ_rows dY_zy)

Convention (documented pair): an allreduce in forward is the identity in backward, and a
gather of a replicated result is a slice in backward. The input and output are replicated over
x, y, z ("easy" layout), so the layer drops into any model. Weight and bias gradients are
complete on each rank after backward: they are tagged data-only, so the gradient sync averages
them over the data axis alone. Splits may be uneven (the partition rule).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hpcpar.parallel import comm as hc
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.partition import part_range, split_sizes
from hpcpar.sync.tags import copy_tags, tag_data_only

from ..errors import LayerError

__all__ = ["TensorParallelLinear", "tensor_parallelize", "full_state_dict"]


def _gather_rows(t: torch.Tensor, comm) -> torch.Tensor:
    """All-gather row blocks (dim 0) of possibly uneven sizes."""
    return t if comm.Get_size() == 1 else hc.allgatherv(t.contiguous(), comm)


def _gather_cols(t: torch.Tensor, comm) -> torch.Tensor:
    """All-gather column blocks (dim 1) of possibly uneven widths."""
    return t if comm.Get_size() == 1 else _gather_rows(t.t(), comm).t().contiguous()


class _TPLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_shard, bias, layer):
        g = layer.grid
        zc, xc, yc = g.axis_comm("z"), g.axis_comm("x"), g.axis_comm("y")
        b0, b1 = part_range(x.shape[0], layer.Z, layer.kz)
        x_zx = x[b0:b1, layer.in_range[0]:layer.in_range[1]].contiguous()
        w_yx = _gather_rows(w_shard, zc)
        y = x_zx @ w_yx.t()
        if layer.X > 1:
            hc.allreduce_(y, xc)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x_zx, w_yx)
        ctx.layer, ctx.batch, ctx.has_bias = layer, x.shape[0], bias is not None
        y = _gather_cols(y, yc)
        return _gather_rows(y, zc)

    @staticmethod
    def backward(ctx, dy):
        layer = ctx.layer
        g = layer.grid
        zc, xc, yc = g.axis_comm("z"), g.axis_comm("x"), g.axis_comm("y")
        x_zx, w_yx = ctx.saved_tensors
        b0, b1 = part_range(ctx.batch, layer.Z, layer.kz)
        dy_zy = dy[b0:b1, layer.out_range[0]:layer.out_range[1]].contiguous()
        dx_zx = dy_zy @ w_yx
        if layer.Y > 1:
            hc.allreduce_(dx_zx, yc)
        dx = _gather_rows(_gather_cols(dx_zx, xc), zc)
        dw_yx = dy_zy.t() @ x_zx
        dw = hc.reduce_scatter(dw_yx, layer.block_rows, zc) if layer.Z > 1 else dw_yx
        db = None
        if ctx.has_bias:
            db = dy_zy.sum(0)
            if layer.Z > 1:
                hc.allreduce_(db, zc)
        return dx, dw, db, None


class TensorParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` with W split over the grid's x, y, z.

    Holds ``weight`` (this rank's shard: rows ``shard_rows`` of the (y, x) block) and ``bias`` (the
    y part of the bias). ``full_weight()`` gathers the whole matrix; ``full_state_dict()`` /
    ``load_full_state_dict(sd)`` speak plain ``nn.Linear`` state dicts (input, output and
    parameters as the module docstring says). ``in_features`` are split over the grid's x axis,
    ``out_features`` over y (and each block's rows over z): an axis with more ranks than its
    features is a LayerError."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 grid: ProcessGrid, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.grid = grid
        self.in_features, self.out_features = in_features, out_features
        _, self.X, self.Y, self.Z = grid.shape
        _, self.kx, self.ky, self.kz = grid.coords
        for axis, parts, n, what in (("x", self.X, in_features, "in_features"),
                                     ("y", self.Y, out_features, "out_features")):
            if parts > n:
                raise LayerError(
                    f"TensorParallelLinear({in_features}, {out_features}): grid axis {axis}={parts}"
                    f" is larger than {what}={n}; use a smaller {axis} or a wider layer")
        self.in_range = part_range(in_features, self.X, self.kx)
        self.out_range = part_range(out_features, self.Y, self.ky)
        rows = self.out_range[1] - self.out_range[0]
        self.block_rows = split_sizes(rows, self.Z)
        self.shard_rows = part_range(rows, self.Z, self.kz)
        self._rows = slice(self.out_range[0] + self.shard_rows[0],   # of the whole weight
                           self.out_range[0] + self.shard_rows[1])
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        full = nn.Linear(in_features, out_features, bias, **factory)  # torch's init, then shard
        self.weight = nn.Parameter(torch.empty(self.block_rows[self.kz],
                                               self.in_range[1] - self.in_range[0], **factory))
        self.bias = nn.Parameter(torch.empty(rows, **factory)) if bias else None
        self._init_from_replicated(full.state_dict())
        for p in self.parameters():
            tag_data_only(p)

    def _init_from_replicated(self, sd) -> None:
        """Make the shards consistent: rank 0 of the spatial group broadcasts its init."""
        full = {k: v.clone() for k, v in sd.items()}
        if self.grid.spatial_size > 1:
            for v in full.values():
                hc.bcast_(v, self.grid.spatial_comm, root=0)
        self.load_full_state_dict(full)

    def load_full_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's shard from a plain ``nn.Linear`` state dict ``{"weight": (out, in),
        "bias": (out,)}``; LayerError if the shapes are not this layer's."""
        w = sd["weight"]
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise LayerError(
                f"TensorParallelLinear: weight shape {tuple(w.shape)} does not match "
                f"({self.out_features}, {self.in_features})")
        with torch.no_grad():
            self.weight.copy_(w[self._rows, self.in_range[0]:self.in_range[1]])
            if self.bias is not None:
                self.bias.copy_(sd["bias"][self.out_range[0]:self.out_range[1]])

    def full_weight(self) -> torch.Tensor:
        """The whole (out, in) matrix on every rank (collective over the spatial group)."""
        full = torch.zeros(self.out_features, self.in_features, dtype=self.weight.dtype,
                           device=self.weight.device)
        full[self._rows, self.in_range[0]:self.in_range[1]] = self.weight.detach()
        return hc.allreduce_(full, self.grid.spatial_comm) if self.grid.spatial_size > 1 \
            else full

    def owns_piece(self, param: nn.Parameter) -> bool:
        """Whether this rank's piece of ``param`` is one no other rank of the spatial group
        holds: every weight block is, the bias (split over y only, repeated over x and z) on
        the ranks where x = z = 0. What counts each piece once: the full bias, the norm."""
        return param is not self.bias or (self.kx == 0 and self.kz == 0)

    def full_bias(self) -> torch.Tensor | None:
        """The whole bias on every rank (collective over the spatial group); None without bias."""
        if self.bias is None:
            return None
        full = torch.zeros(self.out_features, dtype=self.bias.dtype, device=self.bias.device)
        if self.owns_piece(self.bias):
            full[self.out_range[0]:self.out_range[1]] = self.bias.detach()
        return hc.allreduce_(full, self.grid.spatial_comm) if self.grid.spatial_size > 1 \
            else full

    def full_state_dict(self) -> dict:
        """A plain ``nn.Linear`` state dict (collective over the spatial group)."""
        sd: dict = {"weight": self.full_weight()}
        if self.bias is not None:
            sd["bias"] = self.full_bias()
        return sd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise LayerError(f"TensorParallelLinear: input has {x.shape[-1]} "
                             f"features, expected {self.in_features}")
        lead = x.shape[:-1]
        y = _TPLinearFn.apply(x.reshape(-1, self.in_features), self.weight, self.bias, self)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, split x={self.X} y={self.Y} z={self.Z}")


def tensor_parallelize(model: nn.Module, grid: ProcessGrid, min_features: int = 1) -> nn.Module:
    """A tensor-parallel copy of ``model`` (deep-copied, not modified): every ``nn.Linear`` with
    both sides at least ``min_features`` wide replaced by a ``TensorParallelLinear`` holding the
    same weights (so it computes the same function), split over the grid's x, y, z."""
    original, model = model, copy.deepcopy(model)
    copy_tags(original, model)   # a spatialized head's replicated layers stay data-only

    def swap(parent):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and min(child.in_features,
                                                    child.out_features) >= min_features:
                tp = TensorParallelLinear(child.in_features, child.out_features,
                                          child.bias is not None, grid=grid,
                                          dtype=child.weight.dtype)
                tp.load_full_state_dict(child.state_dict())
                setattr(parent, name, tp)
            else:
                swap(child)

    swap(model)
    return model


def full_state_dict(model: nn.Module) -> dict:
    """The model's state dict with tensor-parallel layers gathered (collective): plain
    ``nn.Linear`` keys and shapes, loadable into the plain model."""
    tp = {name: mod.full_state_dict() for name, mod in model.named_modules()
          if isinstance(mod, TensorParallelLinear)}
    sd = {}
    for key, value in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        sd[key] = tp[prefix][leaf] if prefix in tp else value
    return sd
