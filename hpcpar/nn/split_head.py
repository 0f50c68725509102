"""A dense layer after a flatten of a split volume: split, not gathered.

``nn.Flatten()`` (``x.flatten(1)``, ``x.view(x.size(0), -1)``) of a split ``(N, C, D, H, W)``
tensor gives a *flattened split* tensor (:class:`~hpcpar.nn.split.FlatLayout`): this rank holds
the features of its own sub-box, ``C x (d, h, w)`` in its piece's row-major order. The first
``F.linear`` / ``nn.Linear`` on it needs no gather: each rank multiplies its features by the
matching columns of the weight and the partial products are summed over the spatial group::

    forward    y = allreduce(x_local · W_localᵀ) + b        (replicated, as a gathered head's)
    backward   dx_local = dy · W_local;  dW_local = dyᵀ · x_local;  db = Σ dy   (no message)

(allreduce forward, identity backward: the conjugate pair of DESIGN §2; ``dy`` is the same on
every spatial rank, since the loss after the head is computed redundantly and counts once).

Memory divides by the spatial ranks: on its first use the weight Parameter is cut in place
(``p.data``) to this rank's columns, so the optimizer and ``hpcpar.DDP`` keep the same object (a
:class:`~hpcpar.nn.head_grad.CutWeight`; neither may hold state for it yet: see
:func:`hpcpar.nn.spatializer.settle`). Its gradient is complete for its columns: tagged
data-only. ``state_dict()`` gathers the full weight (a collective) and ``load_state_dict`` takes
this rank's columns of a full one: the single-process format. The models guide says which other
ops take a flattened split tensor.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpcpar.parallel.comm import allreduce_, irecv, isend
from hpcpar.parallel.grid import ProcessGrid, coords_of, rank_of
from hpcpar.parallel.halo import autocast_cast
from hpcpar.parallel.primitives import ReplicatedSum

from . import rules, spill
from . import spatial_ops as sops
from .dropout import spatial_dropout
from .head_grad import COLUMNS_ATTR, CutWeight
from .optable import AS_IS
from .split import FlatLayout, SplitTensor, adopt, raw

__all__ = ["ColumnSplit", "column_split", "gathered_to", "has_flat_form"]


@dataclass(frozen=True, eq=False)
class ColumnSplit:
    """Which columns of an ``(out, C*D*H*W)`` weight this rank holds: those of its sub-box ``box``
    of the global ``volume`` ``(C, D, H, W)``, in its piece's row-major order."""

    grid: ProcessGrid
    volume: tuple[int, int, int, int]
    box: tuple[tuple[int, int], ...]
    #: every rank's box, on each root gathered to (None elsewhere): asked once, not at every
    #: checkpoint (a collective per tensor gathered, three per checkpoint under Adam)
    _boxes: dict = field(default_factory=dict, repr=False)

    def __deepcopy__(self, memo):
        return self   # immutable; a grid is never copied

    @property
    def features(self) -> int:   # the global input features, C*D*H*W
        return math.prod(self.volume)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``(..., C*d*h*w)`` columns of a full ``(..., C*D*H*W)`` tensor (a weight,
        its optimizer state, a gradient): autograd-transparent."""
        lead = full.shape[:-1]
        cut = full.reshape(*lead, *self.volume)[_box_index(self.box)]
        return cut.reshape(*lead, -1)

    def gather(self, local: torch.Tensor, root: int | None = None) -> torch.Tensor:
        """The whole ``(..., C*D*H*W)`` tensor from every rank's ``local`` ``(..., C*d*h*w)``
        columns (collective over the spatial group) on every rank; or on ``root`` (of the grid's
        communicator) only, the others getting ``local`` back and holding no more (a full-size
        head on every rank would not divide by the ranks); other spatial groups do nothing."""
        if root is not None:
            return self._gather_to(local, root)
        lead = local.shape[:-1]
        sub = tuple(b - a for a, b in self.box)
        full = local.new_zeros(*lead, *self.volume)
        full[_box_index(self.box)] = local.detach().reshape(*lead, self.volume[0], *sub)
        if self.grid.spatial_size > 1:
            allreduce_(full, self.grid.spatial_comm)
        return full.reshape(*lead, -1)

    def _gather_to(self, local: torch.Tensor, root: int) -> torch.Tensor:
        """:meth:`gather` to ``root`` alone, point to point: the root holds the whole tensor and
        one piece at a time."""
        grid, comm = self.grid, self.grid.spatial_comm
        d, i, j, k = coords_of(root, grid.shape)
        if d != grid.coords[0]:
            return local
        dest = rank_of((0, i, j, k), grid.shape)   # its rank in the spatial communicator
        if dest not in self._boxes:   # the same on every rank: all call this together
            self._boxes[dest] = comm.gather(self.box, root=dest)
        boxes = self._boxes[dest]
        local = local.detach().contiguous()
        if boxes is None:   # not the root: send it this rank's columns
            isend(local, dest, comm).wait()
            return local
        lead = local.shape[:-1]
        full = spill.zeros((*lead, *self.volume), local.dtype, _SPILL[0]) \
            if local.device.type == "cpu" else local.new_zeros(*lead, *self.volume)
        for src, b in enumerate(boxes):
            sub = [hi - lo for lo, hi in b]
            piece = local
            if src != dest:
                piece = local.new_empty(*lead, self.volume[0] * math.prod(sub))
                irecv(piece, src, comm).wait()
            full[_box_index(b)] = piece.reshape(*lead, self.volume[0], *sub)
        return full.reshape(*lead, -1)


def _box_index(box) -> tuple[Any, ...]:
    """A sub-box of a ``(..., C, D, H, W)`` tensor (leading dims and channels whole)."""
    return (Ellipsis, slice(None), *(slice(a, b) for a, b in box))


def column_split(p: Any) -> ColumnSplit | None:
    """The :class:`ColumnSplit` of ``p`` where it was cut to this rank's columns, else None."""
    return getattr(p, COLUMNS_ATTR, None)


# -- state dicts in the single-process format ---------------------------------------------------
_ROOT: list[int | None] = [None]   # where state dicts gather a cut weight (gathered_to)
_SPILL: list[Any] = [None]         # the directory backing what a root gathers (gathered_to)


@contextmanager
def gathered_to(root: int | None, spill_dir: Any = None) -> Iterator[None]:
    """Inside, ``state_dict()`` gathers a cut weight to rank ``root`` of the grid's communicator
    only (None: every rank, the default outside); the others' hold their own columns: a
    checkpoint's writer needs the full weight, no other rank should hold it. ``spill_dir``: where
    what ``root`` gathers on the CPU is file-backed (:mod:`hpcpar.nn.spill`); None: memory."""
    before = _ROOT[0], _SPILL[0]
    _ROOT[0], _SPILL[0] = root, spill_dir
    try:
        yield
    finally:
        _ROOT[0], _SPILL[0] = before


def _state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    for name, p in module._parameters.items():
        info = column_split(p)
        if info is not None and prefix + name in state_dict:
            state_dict[prefix + name] = info.gather(state_dict[prefix + name], _ROOT[0])


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
               errors) -> None:
    for name, p in module._parameters.items():
        info = column_split(p)
        value = state_dict.get(prefix + name)
        if info is not None and isinstance(value, torch.Tensor) and value.dim() == 2 \
                and value.shape[-1] == info.features:
            state_dict[prefix + name] = info.take(value)


def _owner(ctx, param) -> nn.Module | None:
    root = ctx.root() if isinstance(ctx.root, weakref.ref) else None
    if root is None:
        return None
    for mod in root.modules():
        if any(p is param for p in mod._parameters.values()):
            return mod
    return None


def _cut(weight, lay: FlatLayout, call):
    """The Parameter itself, cut to this rank's columns on its first use, else sliced per call."""
    ctx = call.ctx
    info = column_split(weight)
    if info is not None:
        if info.volume != lay.volume or info.grid is not ctx.grid:
            raise call.refuse(f"uses a weight cut for a flattened volume {info.volume} on one "
                              f"of {lay.volume}", "use a separate nn.Linear per input shape")
        ctx.replicated_params.add(id(weight))   # complete for its columns: data-only
        return weight
    info = ColumnSplit(ctx.grid, lay.volume, lay.box())
    owner = _owner(ctx, weight) if isinstance(weight, nn.Parameter) else None
    # used whole (partial gradient, summed) where it cannot be cut: not the model's own, or
    # read whole earlier in this forward (an L2 penalty before the head: that use's saved
    # tensor is the whole weight)
    if owner is None or weight.grad is not None or id(weight) in ctx.replicated_params:
        return info.take(call.replicated(weight))
    with torch.no_grad():
        weight.data = info.take(weight.data).contiguous()
    setattr(weight, COLUMNS_ATTR, info)
    if type(weight) is nn.Parameter:   # norms of its gradient: the whole weight's
        weight.__class__ = CutWeight
    if not getattr(owner, "_hpcpar_column_hooks", False):
        owner.register_state_dict_post_hook(_state_dict_hook)
        owner.register_load_state_dict_pre_hook(_load_hook)
        owner._hpcpar_column_hooks = True  # type: ignore[assignment]  # a plain attribute
    ctx.replicated_params.add(id(weight))
    return weight


# -- the rules ------------------------------------------------------------------------------------
def _linear(call, redo=None):
    if call.name != "linear":
        raise call.refuse("is a matrix product over a flattened split tensor", "use "
                          "F.linear or nn.Linear, which take its features split")
    b = call.bind(("input", "weight", "bias"), (None,))
    x, weight, bias = b["input"], b["weight"], b.get("bias")
    if not isinstance(x, SplitTensor) or any(isinstance(t, SplitTensor) for t in (weight, bias)):
        raise call.refuse("contracts a flattened split tensor with another split one",
                          "use a replicated weight")
    lay = x._hp
    if weight.dim() != 2 or weight.shape[-1] not in (lay.gshape[0], raw(x).shape[-1]):
        raise call.refuse(f"has a weight of shape {tuple(weight.shape)} for "
                          f"{lay.gshape[0]} input features", "give the layer in_features = "
                          "C*D*H*W of the flattened volume")
    y = F.linear(raw(x), _cut(weight, lay, call))
    if call.ctx.grid.spatial_size > 1:
        y = ReplicatedSum.apply(y, call.ctx.grid.spatial_comm)
    if bias is not None:
        if isinstance(bias, nn.Parameter):
            call.ctx.replicated_params.add(id(bias))
        # under autocast, F.linear casts the bias with the other operands: the output keeps
        # the lower-precision dtype, as a plain nn.Linear's (fp16: not promoted to float32)
        y = y + autocast_cast(bias)
    return y


def _pointwise(call, redo=None):
    """Elementwise among tensors of this one flattened layout and scalars."""
    lay = call.layout
    flat = rules.leaves(call.args, call.kwargs)
    for t in flat:
        if isinstance(t, SplitTensor) and t._hp != lay or \
                isinstance(t, torch.Tensor) and not isinstance(t, SplitTensor) and t.dim() > 0:
            raise call.refuse("combines a flattened split tensor with a tensor of another "
                              "layout", "combine it with scalars or tensors flattened alike")
    out = call.func(*call.args, **call.kwargs)
    if call.args and out is call.args[0]:
        return out   # in place: the caller's own object
    return rules.wrap_like(out, lay, 2, flat)


def _dropout(call, redo=None):
    """The split-independent masks of the volume it was flattened from."""
    if call.name != "dropout":
        raise call.refuse("drops features of a flattened split tensor by channel",
                          "use nn.Dropout")
    b = call.bind(("input", "p", "training", "inplace"), (0.5, True, False))
    x = b["input"]
    if not call.ctx.dropout or not b["training"]:
        return x
    lay: FlatLayout = x._hp
    piece = raw(x).reshape(raw(x).shape[0], lay.volume[0], *(b - a for a, b in lay.box()))
    out = spatial_dropout(piece, b["p"], True, False, grid=call.ctx.grid,
                          gshape=lay.volume[1:], feature=False,
                          seed=sops.forward_seed(call.ctx)).reshape(raw(x).shape)
    if b["inplace"]:
        raw(x).copy_(out)
        return x
    return adopt(out, lay)


def _reduction(call, redo=None):
    """A sum or mean over the features (dim 1, or every dim): the global one, replicated (a
    critic's ``flatten(1)`` then ``mean(1)``)."""
    x = call.splits[0]
    b = call.by_name()
    dims = rules._dims_arg(b.get("dim"), x.dim())
    if call.name not in ("sum", "mean") or 1 not in dims:
        raise call.refuse("reduces a flattened split tensor other than by a sum or mean over "
                          "its features", "reduce the spatial dims before flattening")
    keepdim = bool(b.get("keepdim", False))
    piece = raw(x)
    part = piece.sum(dims, keepdim=keepdim, dtype=b.get("dtype"))
    total = ReplicatedSum.apply(part, call.ctx.grid.spatial_comm)
    if call.name == "sum":
        return total
    count = math.prod(x._hp.gshape[0] if d == 1 else piece.shape[d] for d in dims)
    return total / count


def _same_shape(call, redo=None):
    """Only to the shape it has (torch's module backward hooks ``view_as`` an output to itself)."""
    out = rules.same_shape_view(call, *rules.reshape_target(call))
    if out is None:
        raise call.refuse("reshapes a flattened split tensor", "apply the nn.Linear right "
                          "after the flatten, or reduce the spatial dims before flattening")
    return out


FlatLayout.forms.update({rules.pointwise: _pointwise, rules.linear: _linear,
                         sops.dropout: _dropout, sops.reduction: _reduction,
                         rules.reshape: _same_shape})


def has_flat_form(rule: Any) -> bool:
    """Whether ``rule`` runs on a flattened split tensor (F.linear as the head's input only)."""
    return rule in AS_IS or (rule in FlatLayout.forms and rule is not rules.linear)
