"""A cut head weight's gradient: its norms are the whole weight's.

After the first forward a split head's weight holds this rank's columns
(:mod:`hpcpar.nn.split_head`), and so does its ``.grad``. A user's own
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` adds the norms of every gradient it is
given; with the piece it would add this rank's columns only and clip by a per-rank norm, neither
global nor the same on every rank. So the cut weight is a :class:`CutWeight` whose ``.grad`` reads
as a :class:`ColumnGrad`: a norm of it (what ``clip_grad_norm_`` and ``get_total_norm`` take,
``torch._foreach_norm`` or ``torch.linalg.vector_norm`` of each gradient, ``torch.norm``) is the
norm of the whole weight's gradient, its columns' contributions combined over the spatial group (a
collective: every rank of the group takes it, as every rank clips). Replicated parameters' gradients
are whole on every rank and count once; the total is the single-process norm, the same on every
rank, and so is the clipping. Every other op on the gradient (the optimizer's, the gradient sync's,
``.detach()``) sees a plain tensor of this rank's columns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hpcpar.parallel.comm import allreduce_

from .split import refuse
from .view_maps import by_name, dims_arg

__all__ = ["COLUMNS_ATTR", "CutWeight", "ColumnGrad"]

#: The attribute a cut weight Parameter (and its gradient) carries: its
#: :class:`hpcpar.nn.split_head.ColumnSplit`.
COLUMNS_ATTR = "_hpcpar_columns"
_GRAD: Any = torch._C.TensorBase.__dict__["grad"]   # the gradient slot (a descriptor)


class ColumnGrad(torch.Tensor):
    """The gradient of a cut head weight (this rank's columns): norms of it are global."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            whole = _NORMS.get(func)
            return out if whole is None else whole(out, by_name(func, args, kwargs))


class CutWeight(nn.Parameter):
    """A split head's weight once cut (its class is switched in place: the optimizer, the
    gradient sync and the model keep the same object); ``.grad`` reads as a
    :class:`ColumnGrad` and is set as any parameter's."""

    @property
    def grad(self) -> torch.Tensor | None:
        g = _GRAD.__get__(self)
        info = self.__dict__.get(COLUMNS_ATTR)
        if g is not None and info is not None and type(g) is not ColumnGrad:
            g.__class__ = ColumnGrad   # in place: the object the sync and optimizer hold
            g.__dict__[COLUMNS_ATTR] = info
        return g

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _GRAD.__set__(self, value)


def _combine(norm: torch.Tensor, order: float, grad: ColumnGrad) -> torch.Tensor:
    """The norm of order ``order`` over the whole weight from this rank's columns' ``norm``
    (elementwise: a per-row norm combines row by row)."""
    comm = grad.__dict__[COLUMNS_ATTR].grid.spatial_comm
    if comm.Get_size() == 1:
        return norm
    if order in (float("inf"), -float("inf")):
        return allreduce_(norm.detach().clone(), comm, "max" if order > 0 else "min")
    if order == 0:
        return allreduce_(norm.detach().clone(), comm)
    total = allreduce_(norm.detach().double().pow(order), comm)
    return total.pow(1.0 / order).to(norm.dtype)


def _order(value: Any) -> float:
    if value is None or value == "fro":
        return 2.0
    if isinstance(value, str):   # "nuc": a matrix norm, not one of the entries
        raise refuse("norm", f"takes the {value!r} norm of a split head weight's gradient, of "
                     "which this rank holds its columns only", "take a vector norm of it")
    return float(value)


def _foreach_norm(out, b):
    order = _order(b["ord"])
    return [_combine(n, order, g) if type(g) is ColumnGrad else n for n, g in zip(b["input"], out)]


def _vector_norm(out, b):
    """``torch.linalg.vector_norm`` / ``torch.norm`` of one gradient: global over every
    element or per row; a norm over the columns alone would be per column (refused)."""
    grad = b["input"]
    if type(grad) is not ColumnGrad:
        return out
    order = _order(b.get("ord", b.get("p")))
    dims = None if b.get("dim") is None else set(dims_arg(b["dim"], grad.dim()))
    if dims is not None and grad.dim() - 1 not in dims:
        raise refuse("vector_norm", "takes a norm over the rows of a split head weight's "
                     "gradient, of which this rank holds its columns only",
                     "take the norm of the whole gradient or of each row")
    return _combine(out, order, grad)


_NORMS = {torch._foreach_norm: _foreach_norm, torch.linalg.vector_norm: _vector_norm,
          torch.norm: _vector_norm, torch.Tensor.norm: _vector_norm}
